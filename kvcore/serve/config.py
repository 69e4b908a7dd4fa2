"""ServeConfig: everything `mlxkv serve` is started with, validated before the model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..adapters import CONFIG, check_adapter_folder
from ..errors import MlxkvError
from ..policy import KVOptions

DEFAULT_BODY_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    dtype: str | None = None
    kv: KVOptions = field(default_factory=KVOptions)
    host: str = "127.0.0.1"
    port: int = 8080
    batch_size: int = 8
    max_kv_bytes: int | None = None  # None: the device's default budget
    max_queue: int = 64  # requests waiting beyond the running batch; more are refused (429)
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_BODY_BYTES
    max_tokens: int = 512  # a chat request's default (a completion's is OpenAI's 16)
    prefill_chunk: int = 512
    model_name: str | None = None  # the id clients name (default: the model's)
    cors: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0  # seconds running rows get to finish on SIGINT/SIGTERM
    prefix_cache_bytes: int = 0  # RAM for prompt caches reused by later requests (0: off)
    prefix_cache_dir: str | None = None  # a folder the prefix cache spills to and reads back (None: off)
    prefix_cache_dir_bytes: int = 8 * 2**30  # the folder's bound (this server's files)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name clients give as `model`, LoRA adapter folder)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise MlxkvError(f"--port must be in 0..65535, got {self.port}")
        if self.batch_size < 1:
            raise MlxkvError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_queue < 0:
            raise MlxkvError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise MlxkvError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_tokens < 1:
            raise MlxkvError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise MlxkvError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.api_key is not None and not self.api_key.strip():
            raise MlxkvError("--api-key must not be empty")
        if self.prefix_cache_bytes < 0:
            raise MlxkvError(f"--prefix-cache-bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.prefix_cache_dir_bytes < 0:
            raise MlxkvError(f"--prefix-cache-dir-bytes must be >= 0, got {self.prefix_cache_dir_bytes}")
        if self.prefix_cache_dir is not None and not str(self.prefix_cache_dir).strip():
            raise MlxkvError("--prefix-cache-dir must not be empty")
        if self.shutdown_timeout < 0:
            raise MlxkvError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        names = [name for name, _ in self.lora_modules]
        for name, folder in self.lora_modules:
            check_lora_module(name, folder)
            if names.count(name) > 1:
                raise MlxkvError(f"--lora-modules: the name {name!r} is given twice")

    @property
    def max_pending(self) -> int:
        """Requests in flight at most: the running batch plus the queue."""
        return self.batch_size + self.max_queue


def lora_module(value: str) -> tuple[str, str]:
    """`NAME=DIR` (vLLM's --lora-modules form) -> (name, folder)."""
    name, eq, folder = value.partition("=")
    if not eq:
        raise MlxkvError(f"--lora-modules {value!r}: expected NAME=DIR (the model name clients send, an adapter folder)")
    return name.strip(), folder.strip()


def check_lora_module(name: str, folder: str) -> None:
    """A served adapter, before the model loads: a name, an mlx-lm LoRA adapter folder."""
    if not name or any(c.isspace() for c in name):
        raise MlxkvError(f"--lora-modules {name}={folder}: the name must be non-empty, without spaces")
    if not folder:
        raise MlxkvError(f"--lora-modules {name}=: no adapter folder after '='")
    p = check_adapter_folder(folder, "--lora-modules")
    kind = json.loads((Path(p) / CONFIG).read_text()).get("fine_tune_type", "lora")
    if kind != "lora":
        raise MlxkvError(f"--lora-modules {p}: served adapters are LoRA only (rows gather them), this one is {kind!r}")
