"""Predicted KL of compressing one layer's keys or values with one codec, from a window's capture.

For a layer, the exact attention output o at the sampled query positions is recomputed from
the captured Q/K/V; each candidate then changes only what a cache under it would change:
```
key codec c:   s'_tj = q_t . c(k_j)  where query t reads token j encoded, else q_t . k_j
               d_t   = softmax(s'_t) V - o_t
value codec c: d_t   = sum_j a_tj [t reads j encoded] (c(v_j) - v_j)
```
"Reads j encoded" follows CompressedKVCache exactly: j's block is complete and at least
`recent` + 1 positions old (`encoded_visible`); the incomplete last block stays dense. The
error d is scored against the output gradients of the capture (capture.py):
```
predicted mean KL  =  1/2 mean_s sum_(t,h) (g_s,t,h . d_t,h)^2  x  (T - 2) / (P (T - 1))
```
summing the squared dot per query position and head (errors of different positions and heads
are treated as independent: the cross terms of independent quantization errors average out),
scaled from the P positions sampled in [1, T - 1) to the mean over the T - 1 predicted ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..codecs import CodecSpec, make_codec
from .capture import LayerCapture

NEG = -1e30


def encoded_visible(positions: mx.array, T: int, block: int, recent: int) -> mx.array:
    """(P, T) bool: does the query at positions[p] read token j from the encoded store."""
    j = mx.arange(T)
    lag = recent + 1 if recent else 0
    last = j // block * block + block - 1 + lag  # the first query that reads j encoded
    return positions[:, None] >= last[None]


def roundtrip(spec: CodecSpec, x: mx.array) -> tuple[mx.array, int]:
    """x: (H, T, D) -> (decode(encode(x)) for the complete blocks then x as is, block tokens)."""
    codec = make_codec(spec, x.shape[-1])
    bt = codec.block_tokens
    n = x.shape[1] // bt * bt
    if n == 0:
        return x, bt
    dec = _decode(codec, codec.encode(x[None, :, :n]))[0]
    return (mx.concatenate([dec, x[:, n:]], axis=1) if n < x.shape[1] else dec), bt


def _decode(codec, enc) -> mx.array:
    """float32 through the portable decode (the same values): scoring decodes each candidate once, where turbo's
    CUDA launch would first compile and check a kernel per bit width (five of them over 120 s on a loaded H200)."""
    return getattr(codec, "portable_decode", codec.decode)(enc, mx.float32)


@dataclass
class Score:
    predicted: float  # mean KL per predicted position, second-order estimate
    relative: float  # |d|^2 / |o|^2 at the sampled positions (unweighted)


class LayerProxy:
    """One layer of one window: exact attention at the sampled queries, then candidate errors."""

    def __init__(self, cap: LayerCapture, positions: mx.array):
        Hq, T, D = cap.q.shape
        Hkv = cap.k.shape[0]
        self.T, self.positions, self.cap = T, positions, cap
        self.q = cap.q[:, positions].reshape(Hkv, Hq // Hkv, -1, D)  # (Hkv, rep, P, D)
        mask = positions[:, None] >= mx.arange(T)[None]
        if cap.visible is not None:
            mask = mask & cap.visible[positions]
        self.mask = mask  # (P, T)
        self.scores = self._scores(cap.k)  # (Hkv, rep, P, T)
        self.attn = mx.softmax(mx.where(mask, self.scores, NEG), axis=-1)
        self.out = self.attn @ cap.v[:, None]  # (Hkv, rep, P, Dv)
        g = cap.grads
        self.grads = None if g is None else g.reshape(g.shape[0], Hkv, Hq // Hkv, *g.shape[2:])
        self._norm = float((self.out * self.out).sum())
        self._visible: dict[tuple[int, int], mx.array] = {}
        mx.eval(self.scores, self.attn, self.out)

    def _scores(self, k: mx.array) -> mx.array:
        return self.cap.scale * (self.q @ k[:, None].swapaxes(-1, -2))

    def visible(self, block: int, recent: int) -> mx.array:
        key = (block, recent)
        if key not in self._visible:
            self._visible[key] = encoded_visible(self.positions, self.T, block, recent) & self.mask
        return self._visible[key]

    def key_errors(self, spec: CodecSpec, recents) -> list[mx.array]:
        """Output errors (Hkv, rep, P, Dv) of keys under `spec`, one per recent window (one encoding)."""
        k_hat, bt = roundtrip(spec, self.cap.k)
        s_hat = self._scores(k_hat)
        out = []
        for r in recents:
            s = mx.where(self.visible(bt, r), s_hat, self.scores)
            a = mx.softmax(mx.where(self.mask, s, NEG), axis=-1)
            out.append(a @ self.cap.v[:, None] - self.out)
        return out

    def value_errors(self, spec: CodecSpec, recents) -> list[mx.array]:
        v_hat, bt = roundtrip(spec, self.cap.v)
        dv = (v_hat - self.cap.v)[:, None]
        return [mx.where(self.visible(bt, r), self.attn, 0.0) @ dv for r in recents]

    def key_error(self, spec: CodecSpec, recent: int) -> mx.array:
        return self.key_errors(spec, (recent,))[0]

    def value_error(self, spec: CodecSpec, recent: int) -> mx.array:
        return self.value_errors(spec, (recent,))[0]

    def score(self, d: mx.array) -> Score:
        rel = float((d * d).sum()) / max(self._norm, 1e-30)
        if self.grads is None:
            return Score(float("nan"), rel)
        dots = (self.grads * d[None]).sum(axis=-1)  # (S, Hkv, rep, P)
        P = d.shape[2]
        pred = 0.5 * float((dots * dots).sum(axis=(1, 2, 3)).mean()) * (self.T - 2) / (P * (self.T - 1))
        return Score(pred, rel)


def sample_positions(T: int, count: int) -> mx.array:
    """`count` query positions spread evenly over [1, T - 1) (all of them when count >= T - 2)."""
    if count >= T - 2:
        return mx.arange(1, T - 1)
    step = (T - 2) / count
    return mx.array([1 + int(i * step + step / 2) for i in range(count)])
