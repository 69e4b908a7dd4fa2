"""Attention over a compressed past in one fused SDPA call per layer, its transient bounded.

For a chunk of N queries over T stored columns (`kv_attention`'s path whenever the plan fits):
1. the stored tokens are decoded once into one layer-sized scratch (`scratch.decoded`);
2. the mask: `None` / "causal" when positions make it implicit (no window, nothing read two
   ways), so the fused kernel runs unmasked; otherwise a positional (N, T) mask, whose columns
   every query of the chunk sees (the old encoded bulk) are constants and only the band where
   queries differ (the chunk's own blocks, recent tokens, window edges) is computed;
3. one `mx.fast.scaled_dot_product_attention` call, or a few over query groups when the
   call's per-query bytes (the mask's rows; score matrices, where SDPA runs unfused, as on
   CPU) would not fit the budget: group g's queries are read only once group g-1 is computed,
   so one group's transient exists at a time.
The plan (`plan_call`) keeps scratch + mask + max(decode workspace, scores) + queries and
output within `AttentionConfig.scratch_limit`; a view whose scratch alone exceeds it gets
None, and `kv_attention` falls back to the blockwise loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from itertools import pairwise

import mlx.core as mx
import numpy as np

from ..backend import backend_name
from ..cache.view import DENSE, ENCODED, KVView
from . import dense_fold
from .scratch import (
    CallBytes,
    CallShape,
    decoded,
    score_copies,
    sdpa_materializes_scores,
)

SCRATCH_SHARE = 8  # default budget: 1/8 of the device's working set
MIN_BLOCK = 128  # tokens: the blockwise path's smallest block
INFLIGHT_CPU = 4
MIN_CONSTANT_RUN = 128  # columns: shorter runs of always-visible columns are computed with their band


@cache
def default_scratch_bytes() -> int:
    """1/8 of the working set (GPU: its memory; CPU: half of RAM): 17 GB on an H200, 1.3 GB
    on a 16 GB Mac; budgeted runs set `AttentionConfig.scratch_bytes` from `kvcore.transient`."""
    from ..engine.memory import working_set

    return working_set() // SCRATCH_SHARE


def _mask_dtype(dtype: mx.Dtype) -> mx.Dtype:
    # CUDA's fused kernel takes an additive mask; a bool one would be widened there to a
    # (B, Hq, N, T) additive copy
    return dtype if backend_name() == "cuda" else mx.bool_


@dataclass(frozen=True)
class CallPlan:
    bytes: CallBytes
    group: int  # queries per SDPA call
    mask: str | None  # None | "causal" | "array"


def plan_call(shape: CallShape, dtype: mx.Dtype, limit: int) -> CallPlan | None:
    """How the call fits `limit` bytes; None: its scratch (or one query's share) does not."""
    T, n = shape.columns, shape.queries
    tb = shape.token_bytes(dtype)
    scratch = 0 if shape.in_place else T * tb
    workspace = int(shape.encoded * tb * (shape.factor + (shape.segments > 1)))
    q_bytes = shape.batch * shape.q_heads * n * shape.head_dim * dtype.size
    out_bytes = shape.batch * shape.q_heads * n * shape.value_dim * dtype.size
    mask_row = T * _mask_dtype(dtype).size if shape.mask == "array" else 0
    other_row = 3 * T if shape.mask == "array" else 0  # the band's bool working rows (measured 2.7)
    if sdpa_materializes_scores(dtype, shape.head_dim, shape.value_dim, n):
        other_row += (shape.batch * shape.q_heads * T * dtype.size * score_copies(shape.sinks)
                      + (T if shape.mask == "causal" else 0))  # and the bool mask it builds for causal
    per_query = mask_row + other_row
    left = limit - scratch - workspace - q_bytes - out_bytes
    if left < 0:
        return None
    if per_query == 0 or n * per_query <= left:
        group, held = n, 1
    else:  # groups: as many in flight at once as the backend runs ahead
        held = inflight_groups()
        group = (left - out_bytes) // (per_query * held)
    if group < 1:
        return None
    if n > group >= 64:
        group = group // 32 * 32
    io = q_bytes + out_bytes * (1 if group >= n else 2)  # grouped: the groups' outputs and their concatenation
    return CallPlan(CallBytes(scratch, workspace, held * group * mask_row, held * group * other_row, io), group,
                    shape.mask)


def inflight_groups() -> int:
    """Query groups whose transients can exist at once although each waits for the one before:
    MLX's CPU stream runs up to 10 tasks ahead of the graph walk (about 4 groups of 2-3 tasks,
    measured); GPU streams free in stream order."""
    return INFLIGHT_CPU if backend_name() == "cpu" else 1


def fused_attention(q: mx.array, view: KVView, scale: float, sinks, limit: int) -> mx.array | None:
    """q: (B, Hq, N, D) -> (B, Hq, N, Dv) through one fused call (or query groups); None when
    the call does not fit `limit`."""
    N = q.shape[2]
    plan = plan_call(CallShape.of(q.shape, q.dtype, view, sinks is not None), q.dtype, limit)
    if plan is None:
        return None
    keys, vals = decoded(view, q.dtype)
    keys, vals = keys.astype(q.dtype), vals.astype(q.dtype)
    T = keys.shape[2]
    if plan.group >= N:
        mask = _positional_mask(view, 0, N, q) if plan.mask == "array" else plan.mask
        return dense_fold.sdpa(q, keys, vals, scale, mask, sinks)  # a decode query folds where that runs
    outs = []
    for a in range(0, N, plan.group):
        b = min(a + plan.group, N)
        qg = q[:, :, a:b] if not outs else mx.depends([q[:, :, a:b]], [outs[-1]])[0]
        k, v, mask = keys, vals, plan.mask
        if plan.mask == "causal":  # bottom-right causal over the columns up to this group's last query
            k, v = keys[:, :, : T - N + b], vals[:, :, : T - N + b]
        elif plan.mask == "array":
            mask = _positional_mask(view, a, b, qg)
        outs.append(mx.fast.scaled_dot_product_attention(qg, k, v, scale=scale, mask=mask, sinks=sinks))
    return mx.concatenate(outs, axis=2)


def _always_visible(seg, q_first: int, q_last: int, window: int | None, keep: int) -> np.ndarray:
    """(length,) bool: columns of `seg` both the first and the last query see. Each visibility
    rule is monotone in the query position, so these are seen by every query between."""
    j = np.arange(seg.start, seg.start + seg.length)
    out = np.ones(seg.length, dtype=bool)
    for q in (q_first, q_last):
        ok = j <= q
        if window is not None:
            ok &= (j < keep) | (q - j < window - keep)
        if seg.kind != DENSE and (seg.block_tokens > 1 or seg.lag):
            last = seg.start + (j - seg.start) // seg.block_tokens * seg.block_tokens + seg.block_tokens - 1 + seg.lag
            ok &= (q >= last) if seg.kind == ENCODED else (q < last)
        out &= ok
    return out


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """(lo, hi, constant) runs: constant runs are always-visible stretches of at least
    MIN_CONSTANT_RUN columns; the rest is computed."""
    edges = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(flags)]
    runs = []
    for lo, hi in pairwise(bounds):
        const = bool(flags[lo]) and hi - lo >= MIN_CONSTANT_RUN
        if runs and not const and not runs[-1][2]:
            runs[-1] = (runs[-1][0], hi, False)
        else:
            runs.append((lo, hi, const))
    return runs


def _positional_mask(view: KVView, a: int, b: int, q: mx.array) -> mx.array:
    """(b - a, T) mask of queries [a, b) of the view: bool, or additive in q's dtype on CUDA.
    Built from positions that depend on `q`, so a lazy graph builds it when the layer runs
    (not every layer's mask up front)."""
    dtype = _mask_dtype(q.dtype)
    q_pos = mx.depends([mx.arange(view.q_start + a, view.q_start + b)], [q])[0]
    n, pieces = b - a, []
    for seg in view.segments:
        flags = _always_visible(seg, view.q_start + a, view.q_start + b - 1, view.window, view.keep)
        for lo, hi, const in _runs(flags):
            if const:
                pieces.append(mx.ones((n, hi - lo), dtype=mx.bool_) if dtype == mx.bool_
                              else mx.zeros((n, hi - lo), dtype=dtype))
                continue
            m = seg.visible(q_pos, lo, hi, view.window, view.keep)
            pieces.append(m if dtype == mx.bool_ else mx.where(m, mx.array(0, dtype), mx.array(-mx.inf, dtype)))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)


def blockwise_block(q: mx.array, view: KVView, limit: int) -> int:
    """Tokens per block for the blockwise path to stay within `limit`: per column, a block holds
    its decoded K/V and decode workspace, its mask and about four float32 score-sized arrays
    (scores, masked, exp, weights); beside them the queries and two sets of accumulators."""
    B, Hq, N, D = q.shape
    shape = CallShape.of(q.shape, q.dtype, view)
    per_column = shape.token_bytes(q.dtype) * (1 + shape.factor) + 3 * N + 4 * B * Hq * N * 4
    fixed = B * Hq * N * (D * q.dtype.size + 2 * (view.value_dim + 2) * 4)
    return max(MIN_BLOCK, int((limit - fixed) // per_column) // 32 * 32)


def after(seg, q_pos: mx.array, deps: list):
    """(seg, q_pos) whose arrays are read only once `deps` are computed (none: as they are)."""
    if not deps:
        return seg, q_pos
    if seg.joint is not None:
        arrays = seg.joint.arrays
        out = mx.depends([*arrays, q_pos], deps)
        return replace(seg, joint=replace(seg.joint, arrays=tuple(out[:-1]))), out[-1]
    keys, values = _tuple(seg.keys), _tuple(seg.values)
    out = mx.depends([*keys, *values, q_pos], deps)
    k, v = out[: len(keys)], out[len(keys) : -1]
    return replace(seg, keys=tuple(k) if isinstance(seg.keys, tuple) else k[0],
                   values=tuple(v) if isinstance(seg.values, tuple) else v[0]), out[-1]


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)
