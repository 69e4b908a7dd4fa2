"""mlx-lm's BatchKVCache for full-precision rows: no mask where no row is padded, and buffers of whole
256-token steps.

mlx-lm's batch cache always builds an array mask from its left padding; on CUDA an array mask
costs MLX's fused decode-attention kernel. The engine knows on the host when every row holds
the same number of tokens (no padding at all) and says so through `padded`; the mask is then
None for one query ("causal" for several), exactly what the array mask would allow.

Buffers: MLX's CUDA backend hands a one-query decode with no array mask to cuDNN (reading the whole
buffer with a per-row length, one graph per buffer size) only where the keys are a slice, from its first
token, of a buffer a whole number of 256-token steps long (`use_cudnn_for_decoding` in MLX's
scaled_dot_product_attention.cpp) -- the layout of mlx-lm's own KVCache, which is why a lone row gets it.
mlx-lm's BatchKVCache sizes a merged buffer to its longest row and grows by 256 from wherever it ended
(run 20d: 16 rows of 8 193 tokens grew to 8 449), so batch rows fell to MLX's one-query kernel, which reads
each KV head's keys once per query head (`sdpav_2pass`: 597 us a layer, 0.9 TB/s at 16 x 8k on the H200).
Here every buffer is a whole number of steps from its first token: merged rows get the next multiple
(at most 255 tokens a row more), growth goes to the next multiple, and rows leaving (`filter`) or
joining (`extend`) leave a fresh buffer of whole steps.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

STEP = BatchKVCache.step  # 256: mlx-lm's growth step, and the multiple MLX's cuDNN decode path asks of a buffer


def whole_steps(n: int) -> int:
    """The smallest buffer of whole steps that holds `n` tokens (one step for none)."""
    return max(1, -(-n // STEP)) * STEP


class DenseBatchKVCache(BatchKVCache):
    padded = True  # set by the engine's Runner from the rows' lengths (host-side, no sync)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if not self.padded and not return_array and kwargs.get("window_size") is None:
            return None if N == 1 else "causal"
        return super().make_mask(N, return_array=return_array, **kwargs)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's merge (rows right-aligned at the longest row's length, the rest left padding) into buffers of
        whole steps."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches))
        full = [c for c in caches if c.keys is not None]
        B, H, Dk, Dv = len(caches), max(c.keys.shape[1] for c in full), max(c.keys.shape[3] for c in full), \
            max(c.values.shape[3] for c in full)
        dtype, size = full[0].keys.dtype, whole_steps(longest)
        keys, values = mx.zeros((B, H, size, Dk), dtype=dtype), mx.zeros((B, H, size, Dv), dtype=dtype)
        for i, (n, c) in enumerate(zip(lengths, caches)):
            if c.keys is not None:
                keys[i : i + 1, :, longest - n : longest] = c.keys[..., :n, :]
                values[i : i + 1, :, longest - n : longest] = c.values[..., :n, :]
        cache = cls([longest - n for n in lengths])
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    def make_room(self, n: int) -> bool:
        """Grow the buffers (to whole steps) if the next `n` tokens would not fit; whether they grew. The engine's
        Runner calls it before a step's forward and materializes each layer's new buffers at once: grown inside the
        step, every layer's old buffers stay beside its new ones until the step's graph is done (run 20e: a 16 x 8k
        full-precision batch peaked at 43.1 GB for 33.3 of weights and K/V on the step that grew)."""
        if self.keys is None or self._idx + n <= self.keys.shape[2]:
            return False
        self._resize(whole_steps(self._idx + n))
        return True

    def update_and_fetch(self, keys, values):
        self.make_room(keys.shape[2])  # where no one made room before the step
        return super().update_and_fetch(keys, values)  # fits: mlx-lm's growth does not run

    def filter(self, batch_indices):
        size = None if self.keys is None else self.keys.shape[2]
        super().filter(batch_indices)
        if size is not None and self.keys.shape[2] != size:  # left padding dropped: a view from a later token
            self._resize(whole_steps(self.keys.shape[2]), fresh=True)

    def extend(self, other):
        super().extend(other)  # a new buffer, as long as the longer of the two
        if self.keys is not None and self.keys.shape[2] % STEP:
            self._resize(whole_steps(self.keys.shape[2]))

    def _resize(self, size: int, fresh: bool = False) -> None:
        """Buffers of `size` tokens holding what these hold (`fresh`: copied even where no token is added, so a
        view from a later token becomes a buffer from its first)."""
        n = self.keys.shape[2]
        if size == n and not fresh:
            return
        B, H, _, Dk = self.keys.shape
        keys = mx.zeros((B, H, size, Dk), dtype=self.keys.dtype)
        values = mx.zeros((B, H, size, self.values.shape[3]), dtype=self.values.dtype)
        keys[..., :n, :] = self.keys
        values[..., :n, :] = self.values
        self.keys, self.values = keys, values
