from .blockwise import batch_kv_attention, kv_attention, reference_attention
from .hook import AttentionStats, attention_context

__all__ = ["batch_kv_attention", "kv_attention", "reference_attention", "attention_context", "AttentionStats"]
