"""Portable attention over a KVView: blockwise over the KV length with an online softmax.

Neither the whole dequantized KV nor the whole score matrix exists at once: each block of
at most BLOCK columns is decoded, scored and merged into running (max, sum, output)
accumulators in float32, as in flash attention. Runs on every MLX backend (pure MLX ops).
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.view import KVView

BLOCK = 1024
NEG = -1e30


def _dense_fast_path(q, view: KVView, scale, sinks):
    """Everything dense: one fused SDPA call with a positional mask."""
    segs = view.segments
    keys = mx.concatenate([s.keys for s in segs], axis=2) if len(segs) > 1 else segs[0].keys
    vals = mx.concatenate([s.values for s in segs], axis=2) if len(segs) > 1 else segs[0].values
    if view.window is None and len(segs) == 1 and segs[0].start == 0:
        mask = "causal" if view.n_queries > 1 else None
    else:
        q_pos = view.q_positions
        mask = mx.concatenate(
            [s.visible(q_pos, 0, s.length, view.window, view.keep) for s in segs], axis=1
        )
    return mx.fast.scaled_dot_product_attention(
        q, keys.astype(q.dtype), vals.astype(q.dtype), scale=scale, mask=mask, sinks=sinks
    )


def kv_attention(q: mx.array, view: KVView, scale: float, sinks: mx.array | None = None) -> mx.array:
    """q: (B, Hq, N, D) -> (B, Hq, N, Dv), attending over the view's stored tokens."""
    if view.all_dense():
        return _dense_fast_path(q, view, scale, sinks)
    B, Hq, N, D = q.shape
    Hkv, Dv = view.heads, view.value_dim
    rep = Hq // Hkv
    qg = (q * scale).reshape(B, Hkv, rep, N, D)
    m = mx.full((B, Hkv, rep, N, 1), NEG, dtype=mx.float32)  # running max
    l = mx.zeros((B, Hkv, rep, N, 1), dtype=mx.float32)  # running sum of exp
    acc = mx.zeros((B, Hkv, rep, N, Dv), dtype=mx.float32)  # running output
    if sinks is not None:
        # a sink is one extra logit per query head with no value: it only adds to the sum
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1), m.shape)
        l = mx.ones_like(l)
    q_pos = view.q_positions
    for seg in view.segments:
        for lo in range(0, seg.length, BLOCK):
            hi = min(lo + BLOCK, seg.length)
            mask = seg.visible(q_pos, lo, hi, view.window, view.keep)  # (N, T)
            k, v = seg.dense(lo, hi, q.dtype)  # (B, Hkv, T, D)
            s = (qg @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # (B, Hkv, rep, N, T)
            s = mx.where(mask, s, NEG)
            m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
            p = mx.where(mask, mx.exp(s - m_new), 0.0)
            corr = mx.exp(m - m_new)
            l = l * corr + p.sum(axis=-1, keepdims=True)
            acc = acc * corr + p @ v[:, :, None].astype(mx.float32)
            m = m_new
    out = acc / mx.maximum(l, 1e-30)
    return out.reshape(B, Hq, N, Dv).astype(q.dtype)


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


def batch_kv_attention(q: mx.array, view, scale: float, sinks: mx.array | None = None) -> mx.array:
    """q: (B, Hq, N, D) over a BatchKVView: each row attends over its own stored tokens."""
    B, Hq, N, _ = q.shape
    Dv = next(v.value_dim for v in view.rows if v is not None)
    outs = []
    for b, (v, skip) in enumerate(zip(view.rows, view.skips)):
        if v is None:
            outs.append(mx.zeros((1, Hq, N, Dv), dtype=q.dtype))
            continue
        o = kv_attention(q[b : b + 1, :, skip:], v, scale, sinks)
        if skip:
            o = mx.concatenate([mx.zeros((1, Hq, skip, Dv), dtype=o.dtype), o], axis=2)
        outs.append(o)
    return mx.concatenate(outs, axis=0) if B > 1 else outs[0]
