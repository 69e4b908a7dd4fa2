"""Portable attention over a KVView, on every MLX backend (pure MLX ops).

Two paths, chosen by size:
- fused (`prefill.py`): when the call's transient fits `AttentionConfig.scratch_limit`, decode every
  segment once into one scratch and make one `mx.fast.scaled_dot_product_attention` call
  (causal / no mask where positions allow, else a positional mask);
- blockwise: otherwise, blocks of the KV length are decoded, scored and merged into running
  (max, sum, output) accumulators in float32 (online softmax, as in flash attention), so
  neither the whole decoded KV nor the whole score matrix exists at once.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.view import ENCODED, SHADOW, KVView
from . import cuda_decode, dense_fold, prefill, qmm
from .config import DEFAULT, AttentionConfig, AttentionStats

NEG = -1e30


def _setup(view, config: AttentionConfig | None) -> tuple[AttentionConfig, AttentionStats | None]:
    return (config or getattr(view, "config", None) or DEFAULT), getattr(view, "stats", None)


def _count(stats: AttentionStats | None, path: str) -> None:
    if stats is not None:
        stats.record(path)


def _mask(view: KVView):
    """None / "causal" when positions make it implicit, else a (N, columns) bool array."""
    if view.window is None and not any(s.kind == SHADOW for s in view.segments):
        return None if view.n_queries == 1 else "causal"
    q_pos = view.q_positions
    return mx.concatenate([s.visible(q_pos, 0, s.length, view.window, view.keep) for s in view.segments], axis=1)


def _sizes(q, view: KVView) -> tuple[int, int]:
    """(bytes of decoded K+V per token, bytes of scores per token) for this call."""
    B, Hq, N, _ = q.shape
    kv = B * view.heads * (view.head_dim + view.value_dim) * q.dtype.size
    return kv, B * Hq * N * 4


def kv_attention(q: mx.array, view: KVView, scale: float, sinks: mx.array | None = None,
                 config: AttentionConfig | None = None) -> mx.array:
    """q: (B, Hq, N, D) -> (B, Hq, N, Dv), attending over the view's stored tokens; `config`
    (default: the one the view carries) picks the path."""
    cfg, stats = _setup(view, config)
    kernel = cfg.accelerated and cfg.cuda_kernel and (cfg.cuda_min_tokens == 0 or
                                                      q.shape[0] * view.shape[2] >= cfg.cuda_min_tokens)
    out = cuda_decode.view_attention(q, view, scale, sinks) if kernel else None
    keep = view.memo is not None and view.steady and (config is None or config == view.config)  # the cache's own
    if out is not None:
        _count(stats, "cuda-kernel")
        if keep:  # the layer's next steps go straight to it (hook._sdpa), in the rotated basis where this one was
            view.memo["launch"] = cuda_decode.kept_launch
            view.memo.setdefault("rotation", view.segments[0].rotation)  # set already where in_rotated_basis ran
        return out
    kv, sc = _sizes(q, view)
    segs = view.segments
    one_encoded = cfg.accelerated and len(segs) == 1 and segs[0].kind == ENCODED and view.window is None
    if one_encoded and cfg.qmm and qmm.applies(q, segs[0].key_codec, segs[0].value_codec, False):
        _count(stats, "qmm")
        if keep and view.n_queries == 1:
            view.memo["launch"] = kept_qmm  # the layer's next steps go straight to it (hook._sdpa)
        mask = None if view.n_queries == 1 else segs[0].visible(view.q_positions, 0, segs[0].length, None, 0)
        return qmm.qmm_attention(q, *segs[0].parts(), segs[0].key_codec, segs[0].value_codec, scale, mask, sinks)
    if cfg.accelerated and cfg.qmm and len(segs) > 1 and qmm.segments_apply(q, view):  # e.g. a recent dense tail
        _count(stats, "qmm")
        return qmm.segments_attention(q, view, scale, sinks)
    if cfg.block is None:  # one fused call over a layer-sized scratch, if it fits the budget
        out = prefill.fused_attention(q, view, scale, sinks, cfg.scratch_limit)
        if out is not None:
            _count(stats, "fused")
            return out
    _count(stats, "blockwise")
    block = cfg.block or max(prefill.MIN_BLOCK, min(cfg.block_bytes // max(kv, sc) // 128 * 128,
                                                    prefill.blockwise_block(q, view, cfg.scratch_limit)))
    return _blockwise(q, view, scale, sinks, block)


def kept_qmm(q: mx.array, view: KVView, scale: float, sinks: mx.array | None = None) -> mx.array | None:
    """A steady layer's one-query decode from packed words, kept in its cache's memo once `kv_attention`
    has served it so (hook._sdpa tries it first): the same call, without the dispatch; None for more
    queries (the general path decides)."""
    if q.shape[2] != 1:
        return None
    seg = view.segments[0]
    _count(view.stats, "qmm")
    return qmm.qmm_attention(q, *seg.parts(), seg.key_codec, seg.value_codec, scale, None, sinks)


def _segment_blocks(q, view: KVView, block: int, progress: list):
    """(keys, values, mask) per block of each segment; mask (N, T). Each block is read only once
    the accumulators in `progress` are computed, so a lazy graph holds one block at a time."""
    for seg in view.segments:
        for lo in range(0, seg.length, block):
            hi = min(lo + block, seg.length)
            s, q_pos = prefill.after(seg, view.q_positions, progress)
            k, v = s.dense(lo, hi, q.dtype)
            yield k, v, s.visible(q_pos, lo, hi, view.window, view.keep)


def _blockwise(q: mx.array, view: KVView, scale: float, sinks, block: int) -> mx.array:
    progress = []
    return online_softmax(q, _segment_blocks(q, view, block, progress), view.heads, view.value_dim, scale, sinks,
                          progress)


def online_softmax(q: mx.array, blocks, Hkv: int, Dv: int, scale: float, sinks, progress: list | None = None) -> mx.array:
    """Merge attention over blocks of (keys (B, Hkv, T, D), values, mask broadcastable to
    (B, 1, N, T) or (N, T)) with running (max, sum, output) accumulators in float32; `progress`,
    if given, holds the accumulators after each block (for the block source to wait on)."""
    B, Hq, N, D = q.shape
    rep = Hq // Hkv
    qg = (q * scale).reshape(B, Hkv, rep, N, D)
    m = mx.full((B, Hkv, rep, N, 1), NEG, dtype=mx.float32)  # running max
    l = mx.zeros((B, Hkv, rep, N, 1), dtype=mx.float32)  # running sum of exp
    acc = mx.zeros((B, Hkv, rep, N, Dv), dtype=mx.float32)  # running output
    if sinks is not None:
        # a sink is one extra logit per query head with no value: it only adds to the sum
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1), m.shape)
        l = mx.ones_like(l)
    for k, v, mask in blocks:
        if mask.ndim == 4:  # (B, 1, N, T) -> (B, 1, 1, N, T)
            mask = mask[:, :, None]
        s = (qg @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # (B, Hkv, rep, N, T)
        s = mx.where(mask, s, NEG)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        p = mx.where(mask, mx.exp(s - m_new), 0.0)
        corr = mx.exp(m - m_new)
        l = l * corr + p.sum(axis=-1, keepdims=True)
        acc = acc * corr + p @ v[:, :, None].astype(mx.float32)
        m = m_new
        if progress is not None:
            progress[:] = [acc, l]
    out = acc / mx.maximum(l, 1e-30)
    return out.reshape(B, Hq, N, Dv).astype(q.dtype)


def packed_attention(q: mx.array, view, scale: float, sinks: mx.array | None = None,
                     config: AttentionConfig | None = None) -> mx.array:
    """q: (B, Hq, N, D) over a PackedView: every row in one call, masked by its own length. Paged
    rows (a PagedView) go to kvcore.attention.paged, which reads their pages or packs them."""
    if getattr(view, "paged", False):
        from .paged import paged_attention

        return paged_attention(q, view, scale, sinks, config)
    cfg, stats = _setup(view, config)
    B = q.shape[0]
    kv, _ = _sizes(q[:1], view)
    L = view.length
    kernel = cfg.accelerated and cfg.cuda_kernel and B * L >= cfg.cuda_min_tokens
    out = cuda_decode.packed_attention(q, view, scale, sinks) if kernel else None
    if out is not None:
        _count(stats, "cuda-kernel")
        return out
    if cfg.accelerated and cfg.qmm and qmm.applies(q, view.key_codec, view.value_codec, False):
        _count(stats, "qmm")
        parts = (tuple(p[:, :, :L] for p in view.key_parts), tuple(p[:, :, :L] for p in view.value_parts))
        return qmm.qmm_attention(q, *parts, view.key_codec, view.value_codec, scale, view.visible(0, L), sinks)
    if cfg.block is None and B * L * kv <= 4 * cfg.fused_bytes:
        _count(stats, "fused")
        k, v = view.dense(0, L, q.dtype)
        # rows of one length need no array mask (which would cost the fused kernel on CUDA)
        mask = (None if view.n_queries == 1 else "causal") if view.uniform else view.visible(0, L)
        return dense_fold.sdpa(q, k, v, scale, mask, sinks)
    _count(stats, "blockwise")
    block = cfg.block or max(256, cfg.block_bytes // (B * kv) // 128 * 128)
    blocks = ((*view.dense(lo, min(lo + block, L), q.dtype), view.visible(lo, min(lo + block, L)))
              for lo in range(0, L, block))
    return online_softmax(q, blocks, view.heads, view.value_dim, scale, sinks)


def reference_attention(q, keys, values, scale, mask=None, sinks=None):
    """Plain softmax attention in float32 (for tests): q (B,Hq,N,D), keys (B,Hkv,T,D)."""
    B, Hq, N, D = q.shape
    Hkv = keys.shape[1]
    rep = Hq // Hkv
    k = mx.repeat(keys, rep, axis=1).astype(mx.float32)
    v = mx.repeat(values, rep, axis=1).astype(mx.float32)
    s = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mask, s, NEG)
    if sinks is not None:
        sk = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hq, 1, 1), (B, Hq, N, 1))
        s = mx.concatenate([sk, s], axis=-1)
        w = mx.softmax(s, axis=-1)[..., 1:]
    else:
        w = mx.softmax(s, axis=-1)
    return (w @ v).astype(q.dtype)


def _decoded(view: KVView, dtype) -> tuple[mx.array, mx.array]:
    parts = [s.dense(0, s.length, dtype) for s in view.segments]
    if len(parts) == 1:
        return parts[0]
    return mx.concatenate([k for k, _ in parts], axis=2), mx.concatenate([v for _, v in parts], axis=2)


def _stacked_decode(q: mx.array, view, scale: float, sinks) -> mx.array:
    """One query per row: decode each row, left-pad to a common length, one fused SDPA call."""
    rows = [_decoded(v, q.dtype) for v in view.rows]
    T = max(k.shape[2] for k, _ in rows)
    keys, vals, masks = [], [], []
    for (k, v), rv in zip(rows, view.rows):
        pad = T - k.shape[2]
        m = _mask(rv)
        m = mx.ones((1, k.shape[2]), dtype=mx.bool_) if m is None else m  # (1, T_row)
        if pad:
            k = mx.pad(k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            v = mx.pad(v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            m = mx.concatenate([mx.zeros((1, pad), dtype=mx.bool_), m], axis=1)
        keys.append(k)
        vals.append(v)
        masks.append(m)
    mask = mx.stack(masks)[:, None]  # (B, 1, 1, T)
    return dense_fold.sdpa(q, mx.concatenate(keys), mx.concatenate(vals), scale, mask, sinks)


def batch_kv_attention(q: mx.array, view, scale: float, sinks: mx.array | None = None,
                       config: AttentionConfig | None = None) -> mx.array:
    """q: (B, Hq, N, D) over a BatchKVView: each row attends over its own stored tokens."""
    B, Hq, N, _ = q.shape
    first = next(v for v in view.rows if v is not None)
    cfg, stats = _setup(first, config)
    if N == 1 and B > 1 and cfg.block is None and all(v is not None for v in view.rows):
        kv, _ = _sizes(q[:1], view.rows[0])
        if B * max(v.shape[2] for v in view.rows) * kv <= 4 * cfg.fused_bytes:
            _count(stats, "stacked")
            return _stacked_decode(q, view, scale, sinks)
    Dv = next(v.value_dim for v in view.rows if v is not None)
    outs = []
    for b, (v, skip) in enumerate(zip(view.rows, view.skips)):
        if v is None:
            outs.append(mx.zeros((1, Hq, N, Dv), dtype=q.dtype))
            continue
        o = kv_attention(q[b : b + 1, :, skip:], v, scale, sinks, config)
        if skip:
            o = mx.concatenate([mx.zeros((1, Hq, skip, Dv), dtype=o.dtype), o], axis=2)
        outs.append(o)
    return mx.concatenate(outs, axis=0) if B > 1 else outs[0]
