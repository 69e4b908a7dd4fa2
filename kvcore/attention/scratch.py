"""One layer's decoded K/V in one scratch, and what a fused attention call over it costs in memory.

A prefill chunk attends over everything stored for the layer. The stored tokens are decoded
once (per chunk, per layer) into one (B, H, T, D) key and one (B, H, T, Dv) value array, in
column order of the view's segments:

```
columns:  sink (dense) | encoded blocks (decoded) | shadow (dense) | tail (dense)
scratch:  [---------------------------- T columns ----------------------------]
```
A view of one segment is decoded by one call, whose output is the scratch (a lone dense tail
is read as it is stored); a view of several (sinks, recent tokens, the blocks this chunk
encoded) is decoded segment by segment and concatenated, so the decoded encoded part exists
twice for a moment. (Decoding in pieces written into a preallocated scratch does not help
within one lazy evaluation: MLX does not donate a slice_update's input while an earlier
task of the same graph still holds it, measured on CPU.)

`CallBytes` names the parts of one call's transient; the prefill path keeps their sum within
`AttentionConfig.scratch_bytes`, and `kvcore.transient` adds the chunk's activations to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..backend import backend_name
from ..cache.view import DENSE, ENCODED, SHADOW, KVView

UNKNOWN_WORKSPACE = 8.0  # a codec this table does not know: a generous bound
DECODE_QUERIES = 8  # queries of a decode or verify step


def workspace_factor(codec, dtype: mx.Dtype) -> float:
    """Working bytes of `codec`'s decode to `dtype`, per output byte, beyond the output itself
    (tests/test_prefill_memory.py measures them on CPU). CPU: MLX's dequantize works in float32
    (4x a bfloat16 output); the GPUs' is one kernel into its output. Turbo's portable decode widens
    packed words and looks centroids up in float32 before the cast; on CUDA its one-launch decode
    (`turbo_cuda`, where its device check passed) writes its output alone, as affine's does. (Planned with
    the portable factor, turbo's 128k llama-8b prefill does not fit a ~1.6 GB attention budget, a 24 GB
    card's, and every layer goes to the blockwise loop; an H200's 17 GB holds either.) Token-layout
    affine adds the transposed copy of its output."""
    if codec is None:
        return 0.0
    name, half = type(codec).__name__, dtype.size < 4
    if name == "AffineCodec":
        base = (4.1 if half else 1.1) if backend_name() == "cpu" else 0.1
        return base + (1.0 if codec.layout == "token" else 0.0)
    if name == "TurboCodec":
        from ..codecs import turbo_cuda

        if turbo_cuda.serves(codec, dtype):
            return 0.1
        return 5.1 if half else 1.6
    return UNKNOWN_WORKSPACE


def view_workspace_factor(view: KVView, dtype: mx.Dtype) -> float:
    """The largest decode workspace factor among the view's encoded segments."""
    return max((max(workspace_factor(s.key_codec, dtype), workspace_factor(s.value_codec, dtype))
                for s in view.segments if s.kind == ENCODED), default=0.0)


def mask_kind(view: KVView) -> str | None:
    """None (one query), "causal" (positions contiguous, each read one way) or "array"."""
    if view.window is None and not any(s.kind == SHADOW for s in view.segments):
        return None if view.n_queries == 1 else "causal"
    return "array"


@dataclass(frozen=True)
class CallShape:
    """What the memory of one attention call depends on: from a view, or from a model's config
    (`kvcore.transient`) before any view exists."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    queries: int
    columns: int  # stored tokens attended over (T)
    mask: str | None  # None | "causal" | "array"
    in_place: bool = False  # one dense segment: read as stored, no scratch
    segments: int = 1
    encoded: int = 0  # columns of the longest encoded segment (0: none)
    factor: float = 0.0  # decode workspace per output byte (the codecs')
    sinks: bool = False  # attention sinks (one more logit per head)

    @classmethod
    def of(cls, q_shape, dtype: mx.Dtype, view: KVView, sinks: bool = False) -> CallShape:
        segs = view.segments
        if view.memo is not None and view.steady:  # a decode step: its mask and factor are the cache's, kept
            key = ("call factor", dtype)
            factor = view.memo.get(key)
            if factor is None:
                factor = view.memo[key] = view_workspace_factor(view, dtype)
            n = segs[0].length
            return cls(q_shape[0], q_shape[1], view.heads, view.head_dim, view.value_dim, q_shape[2], n,
                       None if view.n_queries == 1 else "causal", False, 1, n, factor, sinks)
        one_dense = len(segs) == 1 and segs[0].kind == DENSE and segs[0].rotation is None
        encoded = max((s.length for s in segs if s.kind == ENCODED), default=0)
        return cls(q_shape[0], q_shape[1], view.heads, view.head_dim, view.value_dim, q_shape[2], view.shape[2],
                   mask_kind(view), one_dense, len(segs), encoded, view_workspace_factor(view, dtype), sinks)

    def token_bytes(self, dtype: mx.Dtype) -> int:
        """Bytes of one decoded column (keys and values, every row and head)."""
        return self.batch * self.kv_heads * (self.head_dim + self.value_dim) * dtype.size


@dataclass(frozen=True)
class CallBytes:
    """The transient of one attention call, by name (bytes)."""

    scratch: int = 0  # decoded K and V of every stored column
    workspace: int = 0  # decode working arrays, and the decoded part a concatenation copies
    mask: int = 0  # the positional array mask, when one is needed
    scores: int = 0  # per query group: score matrices, where the backend's SDPA materializes them
    io: int = 0  # the call's queries and output

    @property
    def total(self) -> int:
        # summed, though the decode workspace is gone before the scores exist: a lazy graph may
        # build the next parts (mask, scores) before the last ones (the concatenation) are freed
        return self.scratch + self.workspace + self.mask + self.scores + self.io

    def to_json(self) -> dict:
        return {**self.__dict__, "total": self.total}


def decoded(view: KVView, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """The view's stored tokens as dense (B, H, T, D) keys and (B, H, T, Dv) values: one
    decode call for a one-segment view, else each segment decoded and concatenated."""
    segs = view.segments
    if len(segs) == 1:  # decode steps may read a joint buffer whole (its spare is at most a growth step)
        return segs[0].dense(0, segs[0].length, dtype, spare_ok=view.n_queries <= DECODE_QUERIES)
    parts = [s.dense(0, s.length, dtype) for s in segs]
    return mx.concatenate([k for k, _ in parts], axis=2), mx.concatenate([v for _, v in parts], axis=2)


def sdpa_materializes_scores(dtype: mx.Dtype, head_dim: int, value_dim: int, n_queries: int) -> bool:
    """Whether MLX's SDPA runs unfused here (score matrices in memory): always on CPU; on CUDA
    outside cuDNN's shapes (fp16/bf16, head dims multiples of 8 up to 128); on Metal for the
    head dims its prefill kernel leaves to the unfused path (192, 256) or does not cover."""
    backend = backend_name()
    if backend == "cpu":
        return True
    if n_queries <= 1:
        return False  # the vector kernels serve single queries
    if backend == "cuda":
        return not (dtype in (mx.float16, mx.bfloat16) and head_dim % 8 == 0 and value_dim % 8 == 0
                    and head_dim <= 128 and value_dim <= 128)
    return head_dim != value_dim or head_dim not in (64, 80, 128)


def score_copies(sinks: bool) -> int:
    """Score-sized arrays alive at once in MLX's unfused SDPA (measured on CPU): one (masking and
    softmax reuse it), three with sinks (their concatenation, then its softmax and slice)."""
    return 3 if sinks else 1
