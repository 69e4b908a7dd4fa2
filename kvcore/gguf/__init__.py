"""Load llama-family GGUF files offline (mx.load) as mlx-lm models, or convert them to folders."""

from kvcore.gguf.convert import build_model, convert_gguf, load_gguf
from kvcore.gguf.reader import GGUFFile, read_gguf

__all__ = ["load_gguf", "convert_gguf", "read_gguf", "build_model", "GGUFFile"]
