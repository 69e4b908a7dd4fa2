"""Attention over a PagedView (kvcore/cache/paged.py): rows' K/V in pages of one pool.

CPU and Metal, affine K/V (mlx-lm's layout), a few queries: the pages are read where they lie
with `mx.gather_qmm`, one (queries x PAGE) product per row, KV head and page:
```
scores[b, h, j] = q[b, h] . K[table[b, j], h]^T          (B, H, pages, rep*N, PAGE)
softmax over (pages, PAGE) per query, masked by each row's positions (and the sinks' logits)
out[b, h]      = sum_j p[b, h, j] . V[table[b, j], h]     (B, H, rep*N, Dv)
```
On CUDA the decode kernel reads the pages through the block table (`cuda_decode.paged_launches`: each
tile's page looked up once). Everything else (other codecs, rotated bases) gathers the pages into
packed rows and attends as packed.py's rows do; that path stays the reference both are tested against.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache.paged import PAGE, PagedView
from . import cuda_decode, qmm
from .blockwise import packed_attention
from .config import DEFAULT, AttentionConfig

_IDX: dict = {}  # the last step's (lhs, rhs key, rhs value) indices, by table array: every layer reads the same


def _indices(view: PagedView) -> tuple[mx.array, mx.array, mx.array]:
    key = (view.heads, view.joint)
    hit = _IDX.get("last")
    if hit is not None and hit[0] == key and hit[1] is view.table:
        return hit[2]
    B, n = view.table.shape
    H = view.heads
    rows = 2 * H if view.joint else H  # heads per page in the key arrays
    h = mx.arange(H, dtype=mx.int32)[None, :, None]
    base = view.table[:, None, :] * rows + h  # (B, H, pages): page j of row b, head h
    lhs = (mx.arange(B, dtype=mx.int32)[:, None, None] * H + h) * mx.ones((1, 1, n), dtype=mx.int32)
    out = (lhs.astype(mx.uint32), base.astype(mx.uint32), (base + (H if view.joint else 0)).astype(mx.uint32))
    _IDX["last"] = (key, view.table, out)
    return out


def _flat(parts: tuple) -> tuple:
    """(P, H', PAGE, W) -> (P * H', PAGE, W): one matrix per page and head."""
    return tuple(p.reshape(p.shape[0] * p.shape[1], *p.shape[2:]) for p in parts)


def gather_qmm_attention(q: mx.array, view: PagedView, scale: float, sinks: mx.array | None = None) -> mx.array:
    """q: (B, Hq, N, D) -> (B, Hq, N, Dv), reading the pages in place."""
    B, Hq, N, D = q.shape
    H, n = view.heads, view.pages
    rep, M = Hq // H, Hq // H * N
    lhs, rk, rv = _indices(view)
    if view.joint:
        kparts = vparts = _flat(view.pool)
    else:
        kparts, vparts = _flat(view.pool[: view.n_key_parts]), _flat(view.pool[view.n_key_parts :])
    kc, vc = view.key_codec, view.value_codec
    wk, sk, bk = kparts
    wv, sv, bv = vparts
    dt = qmm.compute_dtype(q.dtype, sk.dtype, sv.dtype)  # the pool's scales read as stored (fp16 for bf16 queries)
    x = (q * scale).astype(dt).reshape(B * H, M, D)
    s = mx.gather_qmm(x, wk, qmm.as_dtype(sk, dt), qmm.as_dtype(bk, dt), lhs_indices=lhs, rhs_indices=rk, transpose=True,
                      group_size=kc.group, bits=kc.bits).astype(mx.float32)  # (B, H, pages, M, PAGE)
    pos = (mx.arange(n, dtype=mx.int32)[:, None] * PAGE + mx.arange(PAGE, dtype=mx.int32)[None])  # (pages, PAGE)
    qpos = view.q_start.astype(mx.int32)[:, None] + (mx.arange(M, dtype=mx.int32) % N)[None]  # (B, M)
    mask = pos[None, None, :, None, :] <= qpos[:, None, None, :, None]  # (B, 1, pages, M, PAGE)
    s = mx.where(mask, s, -1e30)
    m = s.max(axis=(2, 4), keepdims=True)  # (B, H, 1, M, 1)
    if sinks is not None:
        sk_ = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, 1, rep, 1, 1), (1, H, 1, rep, N, 1)).reshape(1, H, 1, M, 1)
        m = mx.maximum(m, sk_)
    p = mx.where(mask, mx.exp(s - m), 0.0)
    l = p.sum(axis=(2, 4), keepdims=True)
    if sinks is not None:
        l = l + mx.exp(sk_ - m)
    lhs_v = mx.arange(B * H * n, dtype=mx.uint32).reshape(B, H, n)
    o = mx.gather_qmm(p.astype(dt).reshape(B * H * n, M, PAGE), wv, qmm.as_dtype(sv, dt), qmm.as_dtype(bv, dt),
                      lhs_indices=lhs_v, rhs_indices=rv, transpose=False, group_size=vc.group, bits=vc.bits)
    out = o.astype(mx.float32).sum(axis=2) / mx.maximum(l[:, :, 0], 1e-30)  # (B, H, M, Dv)
    return out.reshape(B, Hq, N, -1).astype(q.dtype)


def paged_attention(q: mx.array, view: PagedView, scale: float, sinks: mx.array | None = None,
                    config: AttentionConfig | None = None) -> mx.array:
    cfg = config or view.config or DEFAULT
    if cfg.accelerated and cfg.cuda_kernel and q.shape[0] * view.length >= cfg.cuda_min_tokens:
        out = cuda_decode.paged_attention(q, view, scale, sinks)  # CUDA: the kernel reads the block table
        if out is not None:
            if view.stats is not None:
                view.stats.record("cuda-kernel")
            return out
    if (cfg.accelerated and cfg.qmm and view.rotation is None
            and qmm.applies(q, view.key_codec, view.value_codec, False)):
        if view.stats is not None:
            view.stats.record("qmm")
        return gather_qmm_attention(q, view, scale, sinks)
    return packed_attention(q, view.packed(), scale, sinks, config)
