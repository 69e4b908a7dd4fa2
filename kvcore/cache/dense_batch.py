"""mlx-lm's BatchKVCache for full-precision rows, without a mask where no row is padded.

mlx-lm's batch cache always builds an array mask from its left padding; on CUDA an array mask
costs MLX's fused decode-attention kernel. The engine knows on the host when every row holds
the same number of tokens (no padding at all) and says so through `padded`; the mask is then
None for one query ("causal" for several), exactly what the array mask would allow.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache


class DenseBatchKVCache(BatchKVCache):
    padded = True  # set by the engine's Runner from the rows' lengths (host-side, no sync)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if not self.padded and not return_array and kwargs.get("window_size") is None:
            return None if N == 1 else "causal"
        return super().make_mask(N, return_array=return_array, **kwargs)
