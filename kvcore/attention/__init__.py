from .blockwise import batch_kv_attention, kv_attention, reference_attention
from .config import AttentionConfig, AttentionStats
from .hook import attention_context, attention_stats, bind, install

__all__ = ["AttentionConfig", "AttentionStats", "attention_context", "attention_stats", "batch_kv_attention", "bind",
           "install", "kv_attention", "reference_attention"]
