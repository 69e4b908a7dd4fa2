"""Fused decode attention over affine-packed KV on CUDA (`mx.fast.cuda_kernel`).

An accelerator beside the portable path, for a few queries over per-token affine K/V with
bits in {2, 4, 8}: each thread block takes one (split of the KV length, KV head, row),
dequantizes its keys and values in registers, and writes a partial softmax (max, sum,
weighted values) per query head; the splits are merged with MLX ops (flash decoding).
Selected at run time: only on CUDA, only when the caches' AttentionConfig has `cuda_kernel`
(MLXKV_CUDA_DECODE=1 sets its default; opt-in until its
speed is confirmed on the H200: the first version there was correct but recompiled as the
context grew), and only after a self-check against the portable path on the device has
passed; any failure disables it and the portable path runs.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import backend_name
from ..codecs.affine import AffineCodec

SPLIT = 256  # tokens per thread block
THREADS = 128
_STATE = {"kernel": None, "ok": None, "why": None}

_SOURCE = r"""
    // grid: (splits * THREADS, Hkv, B); one block per (split, kv head, row)
    // dims = [capacity, number of splits]: runtime values, so the kernel compiles once per shape
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int CAP = dims[0], NSPLIT = dims[1];
    const int len = lengths[b];
    const int t0 = split * SPLIT, t1 = min(t0 + SPLIT, len);
    const int per = 32 / BITS, kwords = D / per, groups = D / G;
    const unsigned mask = (BITS == 32) ? 0xffffffffu : ((1u << BITS) - 1u);
    __shared__ float qs[REP][D];
    __shared__ float sc[REP][SPLIT];
    __shared__ float red[REP];
    for (int i = tid; i < REP * D; i += THREADS) {
        int r = i / D, d = i % D;
        qs[r][d] = (float)q[((b * HQ) + h * REP + r) * D + d];
    }
    __syncthreads();
    // scores: one token per thread at a time
    for (int t = t0 + tid; t < t1; t += THREADS) {
        size_t row = ((size_t)(b * HKV + h) * CAP + t);
        float acc[REP];
        for (int r = 0; r < REP; r++) acc[r] = 0.f;
        for (int g = 0; g < groups; g++) {
            float s = (float)ks[row * groups + g], bb = (float)kb[row * groups + g];
            for (int w = g * (G / per); w < (g + 1) * (G / per); w++) {
                unsigned word = kw[row * kwords + w];
                for (int e = 0; e < per; e++) {
                    float x = s * (float)((word >> (e * BITS)) & mask) + bb;
                    int d = w * per + e;
                    for (int r = 0; r < REP; r++) acc[r] += qs[r][d] * x;
                }
            }
        }
        for (int r = 0; r < REP; r++) sc[r][t - t0] = acc[r];
    }
    __syncthreads();
    const int n = t1 - t0;
    if (tid < REP) {
        float m = -1e30f, l = 0.f;
        for (int i = 0; i < n; i++) m = fmaxf(m, sc[tid][i]);
        for (int i = 0; i < n; i++) l += expf(sc[tid][i] - m);
        size_t o = ((size_t)(b * HQ) + h * REP + tid) * NSPLIT + split;
        m_out[o] = m; l_out[o] = l;
        red[tid] = m;
    }
    __syncthreads();
    for (int i = tid; i < REP * n; i += THREADS) {
        int r = i / n, j = i % n;
        sc[r][j] = (n > 0) ? expf(sc[r][j] - red[r]) : 0.f;
    }
    __syncthreads();
    // weighted values: one channel per thread
    const int vwords = DV / per, vgroups = DV / G;
    for (int d = tid; d < DV; d += THREADS) {
        float acc[REP];
        for (int r = 0; r < REP; r++) acc[r] = 0.f;
        const int w = d / per, e = d % per, g = d / G;
        for (int t = t0; t < t1; t++) {
            size_t row = ((size_t)(b * HKV + h) * CAP + t);
            unsigned word = vw[row * vwords + w];
            float x = (float)vs[row * vgroups + g] * (float)((word >> (e * BITS)) & mask) + (float)vb[row * vgroups + g];
            for (int r = 0; r < REP; r++) acc[r] += sc[r][t - t0] * x;
        }
        for (int r = 0; r < REP; r++) {
            size_t o = (((size_t)(b * HQ) + h * REP + r) * NSPLIT + split) * DV + d;
            acc_out[o] = acc[r];
        }
    }
"""


def applies(q: mx.array, key_codec, value_codec) -> bool:
    if backend_name() != "cuda" or _STATE["ok"] is False or q.shape[2] != 1:
        return False
    for c in (key_codec, value_codec):
        if type(c) is not AffineCodec or c.layout != "channel" or c.bits not in (2, 4, 8):
            return False
    return key_codec.bits == value_codec.bits and key_codec.group == value_codec.group


def _kernel():
    if _STATE["kernel"] is None:
        _STATE["kernel"] = mx.fast.cuda_kernel(
            name="mlxkv_affine_decode", input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "lengths", "dims"],
            output_names=["m_out", "l_out", "acc_out"], source=_SOURCE)
    return _STATE["kernel"]


def decode_attention(q: mx.array, key_parts, value_parts, codec, lengths: mx.array, scale: float) -> mx.array:
    """q: (B, Hq, 1, D); parts (B, Hkv, CAP, ...) with row b valid on [0, lengths[b]) -> (B, Hq, 1, Dv)."""
    B, Hq, _, D = q.shape
    kw, ks, kb = key_parts
    vw, vs, vb = value_parts
    Hkv, cap = kw.shape[1], kw.shape[2]
    Dv = vw.shape[-1] * 32 // codec.bits
    nsplit = max(1, (int(mx.max(lengths).item()) + SPLIT - 1) // SPLIT)
    m, l, acc = _kernel()(
        inputs=[(q * scale).reshape(B, Hq, D), kw, ks, kb, vw, vs, vb, lengths.astype(mx.int32),
                mx.array([cap, nsplit], dtype=mx.int32)],
        template=[("HQ", Hq), ("HKV", Hkv), ("REP", Hq // Hkv), ("D", D), ("DV", Dv), ("G", codec.group),
                  ("BITS", codec.bits), ("SPLIT", SPLIT), ("THREADS", THREADS)],
        grid=(nsplit * THREADS, Hkv, B), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, Hq, nsplit), (B, Hq, nsplit), (B, Hq, nsplit, Dv)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    # merge the splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
    M = m.max(axis=-1, keepdims=True)
    w = mx.exp(m - M) * (l > 0)
    out = (w[..., None] * acc).sum(axis=2) / mx.maximum((w * l).sum(axis=-1, keepdims=True), 1e-30)
    return out.reshape(B, Hq, 1, Dv).astype(q.dtype)


def ready() -> bool:
    """Run once: the kernel against the portable arithmetic on a small random case."""
    if _STATE["ok"] is None:
        try:
            codec = AffineCodec(_spec(), 64)
            k, v = mx.random.normal((2, 2, 300, 64)), mx.random.normal((2, 2, 300, 64))
            q = mx.random.normal((2, 4, 1, 64))
            lengths = mx.array([300, 123])
            got = decode_attention(q, codec.encode(k), codec.encode(v), codec, lengths, 0.125)
            kd, vd = codec.decode(codec.encode(k), mx.float32), codec.decode(codec.encode(v), mx.float32)
            mask = (mx.arange(300)[None] < lengths[:, None])[:, None, None]  # (B, 1, 1, T)
            want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask=mask)
            _STATE["ok"] = bool(mx.allclose(got, want, atol=1e-3, rtol=1e-3).item())
            _STATE["why"] = None if _STATE["ok"] else "self-check mismatch"
        except Exception as e:  # a kernel that cannot build or run here: the portable path serves
            _STATE["ok"], _STATE["why"] = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return _STATE["ok"]


def status() -> dict:
    return {"cuda_decode_kernel": _STATE["ok"], "reason": _STATE["why"]}


def _spec():
    from ..codecs import CodecSpec

    return CodecSpec("affine", 4, 64)
