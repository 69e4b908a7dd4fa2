"""A numpy emulation of the CUDA decode kernel's arithmetic (kvcore/attention/cuda_source.py), for CPU tests.

It reads the launches exactly as the kernel does: element d of a token row from the 32-bit word
stream (`o = d * bits, w = o >> 5, sh = o & 31`, two words where the element crosses one),
scores per scale group (`scale * sum q code + bias * sum q`), splits of `chunk` tokens cut from
the capacity by `Plan.splits`, tiles with an online softmax (tile max, rescale), per-query
token bounds, and the merge of the splits with attention sinks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvcore.attention.cuda_launch import PAGE, Plan, Side

NEG = np.float32(-1e30)


def words(a: mx.array) -> np.ndarray:
    """(..., bytes of a row) as little-endian uint32 words, the kernel's view of any stored row."""
    if a.dtype in (mx.bfloat16, mx.float16):
        return np.ascontiguousarray(np.array(mx.view(a, mx.uint16))).view("<u4")
    if a.dtype == mx.float32:
        return np.ascontiguousarray(np.array(a)).view("<u4")
    return np.ascontiguousarray(np.array(a)).view("<u4")  # uint32 words or uint8 bytes


def codes(w: np.ndarray, dim: int, bits: int) -> np.ndarray:
    """(..., RW) uint32 -> (..., dim) uint32: the kernel's `elem` extraction for every d."""
    w = w.astype(np.uint64)
    out = np.empty(w.shape[:-1] + (dim,), dtype=np.uint64)
    mask = (1 << bits) - 1
    for d in range(dim):
        o = d * bits
        wi, sh = o >> 5, o & 31
        u = w[..., wi] >> np.uint64(sh)
        if bits < 32 and sh + bits > 32:
            u = u | (w[..., wi + 1] << np.uint64(32 - sh))
        out[..., d] = u & np.uint64(mask)
    return out.astype(np.uint32)


def dense_values(side: Side, c: np.ndarray) -> np.ndarray:
    if side.dtype == "float32":
        return c.view(np.float32)
    if side.dtype == "bfloat16":
        return (c << np.uint32(16)).view(np.float32)
    return c.astype(np.uint16).view(np.float16).astype(np.float32)


def side_values(side: Side, arrays: tuple, book: mx.array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes-as-values (B, H, T, dim), scales (B, H, T, groups), biases): x = scale * value + bias per group."""
    c = codes(words(arrays[0]), side.dim, side.bits)
    B, H, T = c.shape[:3]
    if side.kind == "affine":
        s = np.array(arrays[1].astype(mx.float32))
        b = np.array(arrays[2].astype(mx.float32))
        return c.astype(np.float32), s, b
    zeros = np.zeros((B, H, T, 1), np.float32)
    if side.kind == "turbo":
        norm = np.array(arrays[1].astype(mx.float32)).reshape(B, H, T, 1)
        return np.array(book)[c], norm, zeros
    return dense_values(side, c), np.ones((B, H, T, 1), np.float32), zeros


def decoded(side: Side, arrays: tuple, book: mx.array) -> np.ndarray:
    x, s, b = side_values(side, arrays, book)
    g = x.reshape(*x.shape[:3], s.shape[-1], -1)
    return (g * s[..., None] + b[..., None]).reshape(x.shape)


def emulate_partials(q: mx.array, launch, plan: Plan, scale: float, heads: int, split=None):
    """(m, l, acc) exactly as the kernel's blocks write them."""
    B, _, N, D = q.shape
    rep, QV, tile = plan.rep, plan.qv, plan.tile
    chunk, nsplit = split or plan.splits(launch.columns, B, heads)
    qf = (np.array(q.astype(mx.float32)) * np.float32(scale)).reshape(B, heads, rep, N, D).reshape(B, heads, QV, D)
    kx, ks, kb = side_values(plan.key, launch.k_arrays, launch.k_book)
    vals = decoded(plan.value, launch.v_arrays, launch.v_book)[:, launch.v_head :]  # joint storage: V from head Hkv
    G = ks.shape[-1]
    rows = np.array(launch.rows)
    table = None if getattr(launch, "table", None) is None else np.array(launch.table)  # paged: arrays are pages
    m = np.full((B, heads, nsplit, QV), NEG, np.float32)
    l = np.zeros((B, heads, nsplit, QV), np.float32)
    acc = np.zeros((B, heads, nsplit, QV, plan.value.dim), np.float32)
    n_of = np.arange(QV) % N
    for b in range(B):
        lo0, hi0, cnt = (int(x) for x in rows[b])
        for h in range(heads):
            qg = qf[b, h].reshape(QV, G, -1)  # (QV, groups, per group)
            for sp in range(nsplit):
                t_begin = max(sp * chunk, max(lo0, 0))
                if table is not None:  # tiles start on tile boundaries: none straddles a page
                    t_begin = t_begin // tile * tile
                t_end = min(sp * chunk + chunk, min(hi0 + N - 1, cnt))
                m_run, l_run = np.full(QV, NEG, np.float32), np.zeros(QV, np.float32)
                a = np.zeros((QV, plan.value.dim), np.float32)
                for t0 in range(t_begin, t_end, tile):
                    js = np.arange(t0, min(t0 + tile, t_end))
                    src, at = (b, js) if table is None else (table[b, t0 // PAGE], t0 % PAGE + js - t0)
                    kg = kx[src, h, at].reshape(len(js), G, -1)  # (T, groups, per group)
                    dots = np.einsum("vge,tge->vtg", qg, kg)  # per group: sum q code
                    s = (dots * ks[src, h, at][None] + kb[src, h, at][None] * qg.sum(-1)[:, None]).sum(-1)
                    ok = (js[None] >= lo0 + n_of[:, None]) & (js[None] < np.minimum(hi0 + n_of[:, None], cnt))
                    s = np.where(ok, s, NEG)
                    mn = np.maximum(m_run, s.max(axis=1))
                    corr = np.exp(m_run - mn)
                    p = np.where(s > NEG / 2, np.exp(s - mn[:, None]), 0.0).astype(np.float32)
                    l_run = l_run * corr + p.sum(axis=1)
                    a = a * corr[:, None] + p @ vals[src, h, at]
                    m_run = mn
                m[b, h, sp], l[b, h, sp], acc[b, h, sp] = m_run, l_run, a
    return m, l, acc


def emulate_merge(parts: list, q_shape, rep: int, sinks: mx.array | None) -> np.ndarray:
    B, Hq, N, _ = q_shape
    m, l, acc = (np.concatenate([p[i] for p in parts], axis=2) for i in range(3))
    M = m.max(axis=2)  # (B, Hkv, QV)
    if sinks is not None:
        sk = np.array(sinks.astype(mx.float32)).reshape(-1, rep)  # (Hkv, rep)
        sk = np.repeat(sk[:, :, None], N, axis=2).reshape(1, -1, rep * N)  # v = r * N + n
        M = np.maximum(M, sk)
    w = np.exp(m - M[:, :, None])
    den = (w * l).sum(axis=2) + (np.exp(sk - M) if sinks is not None else 0.0)
    num = (w[..., None] * acc).sum(axis=2)
    out = np.where(den[..., None] > 0, num / np.maximum(den, 1e-30)[..., None], 0.0)
    Hkv = m.shape[1]
    return out.reshape(B, Hkv, rep, N, -1).reshape(B, Hq, N, -1)


def emulate(q: mx.array, launches: list, heads: int, scale: float, sinks=None) -> np.ndarray:
    rep = q.shape[1] // heads
    plans = [Plan(L.key, L.value, rep, q.shape[2], getattr(L, "table", None) is not None) for L in launches]
    parts = [emulate_partials(q, L, p, scale, heads) for L, p in zip(launches, plans)]
    return emulate_merge(parts, q.shape, rep, sinks)
