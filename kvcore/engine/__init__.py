from .engine import Engine, GenerateConfig
from .forward import convert_due, forward, prefill
from .generate import decode_tokens, generate_one
from .sampling import SamplingConfig
from .sequence import Completion, Request, Sequence, TokenEvent
from .stats import kv_summary

__all__ = ["Completion", "Engine", "GenerateConfig", "Request", "SamplingConfig", "Sequence", "TokenEvent",
           "convert_due", "decode_tokens", "forward", "generate_one", "kv_summary", "prefill"]
