"""Small helpers shared by tests: run our engine, run mlx-lm, measure greedy margins."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from kvcore.attention import attention_stats
from kvcore.codecs import AffineCodec, register_codec
from kvcore.engine import GenerateConfig, Request, generate_one
from kvcore.fidelity import teacher_forced_logprobs
from kvcore.policy import KVOptions, build_caches, resolve_policy

PROMPT = "Once upon a time there was a little girl. She liked to play with her big red ball in the park."
ROW_PROMPTS = [  # rows of different lengths, for batched and speculative runs
    "Once upon a time there was a little girl named Lily.",
    "The dog",
    "She liked to play with her big red ball in the park every day. One day",
    "Tom",
]


def per_family(tiny_models, make):
    """get(family) -> make(path, model, tokenizer): a fixture family loaded and prepared once."""
    memo = {}

    def get(family):
        if family not in memo:
            path = str(tiny_models(family))
            memo[family] = make(path, *load(path))
        return memo[family]

    return get


def ours(model, tok, ids, n, opts: KVOptions = KVOptions(), chunk: int = 512):
    """(tokens, AttentionStats) of a greedy run with mlxkv's engine under `opts`."""
    policy = resolve_policy(opts)
    caches, _ = build_caches(model, policy)
    c = generate_one(model, tok, Request(tuple(ids), n), caches, GenerateConfig(prefill_chunk=chunk))
    return c.token_ids, attention_stats(caches)


def mlx_lm_greedy(model, ids, n, prompt_cache=None):
    """(tokens, min top-1 margin) from mlx-lm's own generate_step."""
    toks, margin = [], float("inf")
    for tok, logprobs in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=prompt_cache):
        top2 = mx.sort(logprobs)[-2:]
        margin = min(margin, (top2[1] - top2[0]).item())
        toks.append(int(tok))
    return toks, margin


def greedy_margins(model, ids, generated, opts: KVOptions, chunk: int = 64) -> list[float]:
    """Top-1 margin at each generated position, teacher-forced through `opts`' caches."""
    caches, _ = build_caches(model, resolve_policy(opts))
    lp = teacher_forced_logprobs(model, list(ids) + list(generated), caches, chunk)
    steps = lp[len(ids) - 1 : len(ids) - 1 + len(generated)]
    top2 = mx.sort(steps, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()


def margin_under(model, ids, generated, opts: KVOptions, chunk: int = 64) -> float:
    """Min top-1 margin over the generated positions, teacher-forced through `opts`' caches."""
    return min(greedy_margins(model, ids, generated, opts, chunk))


def tie_free_prefix(model, ids, generated, opts: KVOptions, tie: float = 0.1) -> int:
    """How many leading generated tokens have a top-1 margin of at least `tie` under `opts`.

    Quantized KV is only chunk-invariant up to rounding: a different prefill matmul shape can
    move a value across a quantization bin, so a near-tie may legitimately resolve either way.
    Token equality is asserted up to the first such near-tie.
    """
    margins = greedy_margins(model, ids, generated, opts)
    return next((i for i, m in enumerate(margins) if m < tie), len(margins))


def assert_rows_equal_to_near_ties(model, reqs, alone: list, batched: list, opts: KVOptions, tie: float = 1e-2,
                                   compared: float = 0.8) -> None:
    """Batched rows == the same rows alone, token for token up to each row's first near-tie (a top-1 margin under
    `tie` in the row's own teacher-forced run: there the greedy token is rounding's to pick, and a batch's
    products round differently from one row's, e.g. with OpenBLAS's kernels for another CPU). Rows that match
    whole cost nothing; at least `compared` of all tokens must fall before a tie, so the check cannot thin out."""
    if batched == alone:
        return
    assert len(batched) == len(alone)
    total = sum(len(a) for a in alone)
    checked = 0
    for i, (r, a, b) in enumerate(zip(reqs, alone, batched)):
        n = len(a) if a == b else tie_free_prefix(model, r.prompt_ids, a, opts, tie)
        assert b[:n] == a[:n], f"row {i} differs before its first near-tie (position {n})"
        checked += n
    assert checked >= compared * total, (checked, total)


class DoubledScales(AffineCodec):
    """Negative control for fidelity bounds: decodes with every scale doubled."""

    def decode(self, enc, dtype):
        w, s, b = enc
        return super().decode((w, s * 2, b), dtype)


register_codec("affine-doubled", DoubledScales)
