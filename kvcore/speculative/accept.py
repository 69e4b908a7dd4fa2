"""Which draft tokens a row keeps: exact match when greedy, the speculative sampling rule
otherwise (Leviathan et al. 2023; gpt-fast's `speculative_decode`).

A row fed the target [y, d1 .. dc] and got distributions q_0 .. q_c (q_j: the token after
position j). It emits d1 .. da and one token from the target:
  greedy:  a = how many leading drafts equal the target's argmax; then argmax q_a.
  sampled: q target prob, p draft prob of d_j
           q >= p: always keep d_j;  q < p: keep it with probability q/p
           first rejection at j: a token from the residual max(0, q_j - p_j), normalized
           all c kept: a token from q_c
so every emitted token is distributed as plain sampling from the target would have been.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..engine.sampling import SamplingConfig


@dataclass
class Verdict:
    accepted: list[int]  # drafts kept, per row
    tokens: list[list[int]]  # emitted, per row: the kept drafts, then the target's token


def sampling_probs(cfg: SamplingConfig, logits: mx.array) -> mx.array:
    """(..., V) logits -> the distribution plain sampling draws from (temp, top-p, min-p, top-k)."""
    lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)
    return mx.softmax(cfg.filter(lp) / cfg.temp, axis=-1)


def accept_greedy(logits: mx.array, drafts: list[list[int]]) -> Verdict:
    """logits: (B, K, V), K >= 1 + len(drafts[b]) for every row."""
    best = mx.argmax(logits, axis=-1).tolist()
    accepted, tokens = [], []
    for d, t in zip(drafts, best):
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        accepted.append(a)
        tokens.append(list(d[:a]) + [t[a]])
    return Verdict(accepted, tokens)


def _fit(p: mx.array, V: int) -> mx.array:
    """Draft distributions over the target's vocabulary size (drafts may pad theirs)."""
    if p.shape[-1] > V:
        return p[..., :V]
    if p.shape[-1] < V:
        return mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, V - p.shape[-1])])
    return p


def accept_sampled(q: mx.array, drafts: list[list[int]], p: mx.array | None = None) -> Verdict:
    """q: (B, K, V) target probabilities; p: (B, >= K-1, V) draft probabilities, or None for
    point masses on the drafts (prompt lookup)."""
    B, K, V = q.shape
    c = mx.array([len(d) for d in drafts])[:, None]  # (B, 1)
    D = mx.array([list(d) + [0] * (K - 1 - len(d)) for d in drafts], dtype=mx.int32).reshape(B, K - 1)
    if p is None:
        p = (D[..., None] == mx.arange(V)).astype(mx.float32)  # (B, K-1, V) point masses
    else:
        p = _fit(p, V)[:, : K - 1].astype(mx.float32)
    if K > 1:
        Dc = mx.minimum(D, V - 1)[..., None]  # an id past the target's vocabulary: q = 0, rejected
        qd = mx.where(D < V, mx.take_along_axis(q[:, : K - 1], Dc, axis=-1)[..., 0], 0.0)  # (B, K-1)
        pd = mx.take_along_axis(p, Dc, axis=-1)[..., 0]
        keep = (mx.random.uniform(shape=(B, K - 1)) * pd < qd) & (mx.arange(K - 1)[None] < c)
        a = mx.cumprod(keep.astype(mx.int32), axis=1).sum(axis=1)  # (B,) leading kept
    else:
        a = mx.zeros((B,), dtype=mx.int32)
    # past a row's drafts p is 0, so the residual there is q itself (the bonus token)
    p_ext = mx.concatenate([p, mx.zeros((B, 1, V))], axis=1) * (mx.arange(K)[None] < c)[..., None]
    residual = mx.maximum(q.astype(mx.float32) - p_ext, 0.0)
    x = mx.random.categorical(mx.log(residual), axis=-1)  # (B, K) one candidate per position
    last = mx.take_along_axis(x, a[:, None], axis=1)[:, 0]
    accepted, ends = a.tolist(), last.tolist()
    return Verdict(accepted, [list(d[:n]) + [e] for d, n, e in zip(drafts, accepted, ends)])


def row_logprobs(logits: mx.array, tokens: list[list[int]], asked: list[int | None]) -> list[list[dict] | None]:
    """Per row, the target's log-probabilities of its emitted tokens (position j's distribution
    gave token j), with the top N it asked for; None for rows that asked for none.
    logits: (B, K, V) from the verifying pass."""
    from ..engine.sampling import pack_logprobs, unpack_logprobs

    if all(a is None for a in asked):
        return [None] * len(tokens)
    B, K, V = logits.shape
    chosen = mx.array([list(t) + [0] * (K - len(t)) for t in tokens], dtype=mx.int32).reshape(B * K)
    lp = logits.reshape(B * K, V).astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    packed = pack_logprobs(chosen, lp, max(a for a in asked if a is not None)).reshape(B, K, -1).tolist()
    return [None if a is None else [unpack_logprobs(packed[b][j], a)[1] for j in range(len(tokens[b]))]
            for b, a in enumerate(asked)]
