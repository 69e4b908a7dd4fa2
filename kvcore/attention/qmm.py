"""Decode attention straight from affine-packed KV with `mx.quantized_matmul` (CPU, Metal).

An accelerator beside the portable path: for a few queries over per-token affine K/V
(mlx-lm's layout), the scores and the output are computed from the packed words without
decoding the cache first. The score matrix is (queries x tokens), small in decode. Not used
on CUDA, where quantized_matmul has no kernel for these shapes; `kv_attention` stays the
reference it is tested against.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import backend_name
from ..codecs.affine import AffineCodec

MAX_QUERIES = 8  # decode and short verify steps; prefill goes through the fused/blockwise path


def _affine_channel(codec) -> bool:
    return type(codec) is AffineCodec and codec.layout == "channel"


def applies(q: mx.array, key_codec, value_codec, has_mask_rules: bool) -> bool:
    return (q.shape[2] <= MAX_QUERIES and not has_mask_rules and backend_name() != "cuda"
            and _affine_channel(key_codec) and _affine_channel(value_codec))


def segments_apply(q: mx.array, view) -> bool:
    """Whether `segments_attention` serves this view: no window, every encoded segment per-token affine
    (read from its words), the others dense, none in a rotated basis (a recent tail: `affine:4/r16`)."""
    if q.shape[2] > MAX_QUERIES or backend_name() == "cuda" or view.window is not None:
        return False
    encoded = [s for s in view.segments if s.kind == "encoded"]
    return bool(encoded) and all(s.rotation is None for s in view.segments) and all(
        s.block_tokens == 1 and _affine_channel(s.key_codec) and _affine_channel(s.value_codec) for s in encoded)


def segments_attention(q: mx.array, view, scale: float, sinks: mx.array | None = None) -> mx.array:
    """Decode attention over a view of several segments (an encoded past, a recent dense tail, its
    shadow): encoded segments scored and summed from their packed words, dense ones by matmul, one
    softmax over all the columns, each segment under its own visibility -> (B, Hq, N, Dv)."""
    B, Hq, N, D = q.shape
    Hkv, segs = view.heads, [s for s in view.segments if s.length]
    rep = Hq // Hkv
    (_, enc_ks, _), (_, enc_vs, _) = next(s for s in segs if s.kind == "encoded").parts()
    dt = compute_dtype(q.dtype, enc_ks.dtype, enc_vs.dtype)
    qg = (q * scale).astype(dt).reshape(B, Hkv, rep * N, D)
    scores, stored = [], []
    for seg in segs:
        if seg.kind == "encoded":
            (wk, sk, bk), vparts = seg.parts()
            sc = mx.quantized_matmul(qg, wk, as_dtype(sk, dt), as_dtype(bk, dt), transpose=True,
                                     group_size=seg.key_codec.group, bits=seg.key_codec.bits)
        else:
            k, vparts = seg.dense(0, seg.length, dt)
            sc = qg @ k.swapaxes(-1, -2)
        visible = seg.visible(view.q_positions, 0, seg.length, None, 0)  # (N, T)
        scores.append(mx.where(visible, sc.astype(mx.float32).reshape(B, Hkv, rep, N, -1), -1e30))
        stored.append((seg, vparts))
    if sinks is not None:
        scores.insert(0, mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1), (B, Hkv, rep, N, 1)))
    p = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1)
    lo = 1 if sinks is not None else 0
    out = None
    for seg, vparts in stored:
        pi = p[..., lo : lo + seg.length].reshape(B, Hkv, rep * N, -1).astype(dt)
        lo += seg.length
        if seg.kind == "encoded":
            wv, sv, bv = vparts
            o = mx.quantized_matmul(pi, wv, as_dtype(sv, dt), as_dtype(bv, dt), transpose=False,
                                    group_size=seg.value_codec.group, bits=seg.value_codec.bits)
        else:
            o = pi @ vparts
        out = o if out is None else out + o
    return out.reshape(B, Hq, N, -1).astype(q.dtype)


def qmm_attention(q: mx.array, key_parts, value_parts, key_codec, value_codec, scale: float,
                  mask: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """q: (B, Hq, N, D); parts: (B, Hkv, T, ...) packed words, scales, biases; mask broadcastable
    to (B, 1, N, T) or None -> (B, Hq, N, Dv)."""
    B, Hq, N, D = q.shape
    Hkv = key_parts[0].shape[1]
    rep = Hq // Hkv
    dt = compute_dtype(q.dtype, key_parts[1].dtype, value_parts[1].dtype)
    # a KV head's query vectors as the rows of one product: the parts are read as they are (B, Hkv, T, ...)
    qg = (q * scale).astype(dt).reshape(B, Hkv, rep * N, D)
    wk, sk, bk = key_parts
    s = mx.quantized_matmul(qg, wk, as_dtype(sk, dt), as_dtype(bk, dt), transpose=True,
                            group_size=key_codec.group, bits=key_codec.bits).astype(mx.float32)
    if mask is None and sinks is None:  # the decode step
        p = mx.softmax(s, axis=-1)
    else:
        s = s.reshape(B, Hkv, rep, N, -1)
        if mask is not None:
            s = mx.where(mask[:, :, None] if mask.ndim == 4 else mask, s, -1e30)  # (B, Hkv, rep, N, T)
        if sinks is not None:
            sk_ = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1), (B, Hkv, rep, N, 1))
            p = mx.softmax(mx.concatenate([sk_, s], axis=-1), axis=-1)[..., 1:]
        else:
            p = mx.softmax(s, axis=-1)
        p = p.reshape(B, Hkv, rep * N, -1)
    wv, sv, bv = value_parts
    out = mx.quantized_matmul(p.astype(dt), wv, as_dtype(sv, dt), as_dtype(bv, dt), transpose=False,
                              group_size=value_codec.group, bits=value_codec.bits)
    return out.reshape(B, Hq, N, -1).astype(q.dtype)


HALF = (mx.float16, mx.bfloat16)


def compute_dtype(q_dtype, key_scales, value_scales, backend: str | None = None):
    """The dtype both products run in.
    - CPU: float32 for half-precision queries. MLX's CPU quantized_matmul emulates half arithmetic:
      bf16 queries at 2k tokens decoded at 102 ms a step in fp16, 15.8 in bf16 and 4.3 in float32 (the
      scales then cast every step, a pass over 1/8 of the packed bytes; BENCHMARKS.md).
    - Metal: the scales' own fp16 for bf16 queries (fp16 has 3 more mantissa bits for scores and
      probabilities, and the cache's scale arrays, as long as the context, are then read as stored
      instead of cast every step), else the queries' dtype."""
    if q_dtype in HALF and (backend or backend_name()) == "cpu":
        return mx.float32
    if q_dtype == mx.bfloat16 and key_scales == mx.float16 and value_scales == mx.float16:
        return mx.float16
    return q_dtype


def as_dtype(a: mx.array, dtype) -> mx.array:
    """`a` in `dtype`, itself where it already is (no copy node)."""
    return a if a.dtype == dtype else a.astype(dtype)
