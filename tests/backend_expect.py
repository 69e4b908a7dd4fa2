"""What mlx-lm cannot do on a backend, asserted where a test meets it (never skipped).

On CUDA mlx-lm's quantized KV attention fails: `mx.quantized_matmul` has no kernel for its
sliced (non-contiguous) QuantizedKVCache, e.g. BENCHMARKS.md's H200 run:
`[quantized_matmul] No implementation for problem shape: 1x513x128x32, transpose: true, ...`.
mlxkv never takes that path there (its qmm accelerator is CPU/Metal only); tests that meet
mlx-lm's quantized rows assert this documented failure on CUDA and the working rows elsewhere.
"""

from __future__ import annotations

import mlx.core as mx

from kvcore.backend import backend_name

MLX_LM_QUANTIZED_FAILS = backend_name() == "cuda"
QMM_FAILURE = "[quantized_matmul] No implementation"


def mlx_lm_quantized_runs(error: str | None) -> bool:
    """Whether mlx-lm's quantized KV ran here: False on CUDA after asserting that `error` is its
    documented failure; elsewhere asserts there was no error."""
    if MLX_LM_QUANTIZED_FAILS:
        assert error is not None and QMM_FAILURE in error, error
        return False
    assert error is None, error
    return True


def mlx_lm_quantized_attention_error(bits: int, group: int, tokens: int = 50) -> str | None:
    """One decode step of mlx-lm's own quantized attention (its QuantizedKVCache and
    `scaled_dot_product_attention`) over `tokens` cached tokens, GQA 6/2, head_dim 64: its error, or None."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=group, bits=bits)
    cache.update_and_fetch(mx.random.normal((1, 2, tokens, 64)), mx.random.normal((1, 2, tokens, 64)))
    k, v = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    try:
        mx.eval(scaled_dot_product_attention(mx.random.normal((1, 6, 1, 64)), k, v, cache, 0.125, None))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None
