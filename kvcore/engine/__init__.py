from .forward import convert_due, forward, prefill
from .generate import Completion, GenerateConfig, Request, decode_tokens, generate_one
from .sampling import SamplingConfig
from .stats import kv_summary

__all__ = ["Completion", "GenerateConfig", "Request", "SamplingConfig", "convert_due", "decode_tokens",
           "forward", "generate_one", "kv_summary", "prefill"]
