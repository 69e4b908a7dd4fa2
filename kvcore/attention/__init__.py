from .blockwise import kv_attention, reference_attention
from .hook import AttentionStats, attention_context

__all__ = ["kv_attention", "reference_attention", "attention_context", "AttentionStats"]
