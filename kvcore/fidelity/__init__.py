"""Fidelity: how far a KV scheme moves a model's next-token distributions from full precision.

- `teacher_forced.py`: feed a text through real caches in chunks; KL, top-1 agreement and
  perplexity against a full-precision reference on the same tokens (`Fidelity`, `TokenStats`).
- `bytes.py`: KV bytes as a float16 deployment stores them (`kv_bytes`).
- `schemes.py`: the schemes a run compares (`--kv` values and mlx-lm's QuantizedKVCache).
- `run.py`: the whole job, texts -> windows -> each scheme (`FidelityJob`, `run_fidelity`).
"""

from .teacher_forced import (
    Fidelity,
    TokenStats,
    compare,
    pool,
    teacher_forced_chunk,
    teacher_forced_logprobs,
    teacher_forced_stats,
    token_stats,
)

__all__ = [
    "Fidelity",
    "TokenStats",
    "compare",
    "pool",
    "teacher_forced_chunk",
    "teacher_forced_logprobs",
    "teacher_forced_stats",
    "token_stats",
]
