"""Speculative decoding, model-free parts: the sampling rule, prompt lookup, cache rollback."""

import mlx.core as mx
import pytest

from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import FULL, CodecSpec
from kvcore.speculative import RollbackError, SpecStats, Verdict, accept_greedy, accept_sampled, lookup
from kvcore.speculative.rows import trim_rows

# --- the sampling rule: a Markov chain over a tiny vocabulary ------------------------------
V, N, K = 4, 20000, 3
P = mx.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.3, 0.3, 0.3, 0.1], [0.05, 0.15, 0.3, 0.5]])  # target
Q = mx.array([[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]])  # draft
CHI2_15_999 = 37.70  # chi-square, 15 degrees of freedom, 0.999 quantile


def accept_always(q, drafts, p=None) -> Verdict:
    """Deliberately wrong: keeps every draft, then samples from the target."""
    last = mx.random.categorical(mx.log(q[:, -1]), axis=-1).tolist()
    return Verdict([len(d) for d in drafts], [list(d) + [t] for d, t in zip(drafts, last)])


def one_round(x: mx.array, rule, point_mass: bool) -> list[list[int]]:
    """From last tokens x (N,): draft K tokens, verify with `rule`, return emitted tokens."""
    fed, ps = [x], []
    for _ in range(K):
        if point_mass:  # a deterministic draft (prompt-lookup-like): the next token is (t + 1) % V
            fed.append((fed[-1] + 1) % V)
        else:
            ps.append(Q[fed[-1]])
            fed.append(mx.random.categorical(mx.log(ps[-1]), axis=-1))
    tokens = mx.stack(fed, axis=1)  # (N, K+1)
    q = P[tokens]  # (N, K+1, V): the target's distribution after each fed token
    drafts = tokens[:, 1:].tolist()
    return rule(q, drafts, None if point_mass else mx.stack(ps, axis=1)).tokens


def chi2_of_first_two(rule, point_mass: bool) -> float:
    """Joint law of the first two emitted tokens vs the target chain's P(a|0) P(b|a)."""
    mx.random.seed(7)
    first = one_round(mx.zeros((N,), dtype=mx.int32), rule, point_mass)
    a = [t[0] for t in first]
    nxt = one_round(mx.array(a), rule, point_mass)  # used only where round one emitted one token
    b = [t[1] if len(t) > 1 else n[0] for t, n in zip(first, nxt)]
    counts = [[0] * V for _ in range(V)]
    for i, j in zip(a, b):
        counts[i][j] += 1
    p0 = P[0].tolist()
    Pl = P.tolist()
    return sum((counts[i][j] - N * p0[i] * Pl[i][j]) ** 2 / (N * p0[i] * Pl[i][j]) for i in range(V) for j in range(V))


@pytest.mark.parametrize("point_mass", [False, True])
def test_sampling_rule_preserves_the_target_distribution(point_mass):
    assert chi2_of_first_two(accept_sampled, point_mass) < CHI2_15_999
    assert chi2_of_first_two(accept_always, point_mass) > 10 * CHI2_15_999  # the test has power


def test_sampling_rule_rejects_drafts_outside_the_target_vocabulary():
    q = mx.array([[[0.5, 0.5], [0.5, 0.5]]])
    v = accept_sampled(q, [[7]], mx.array([[[0.0] * 7 + [1.0]]]))
    assert v.accepted == [0] and v.tokens[0][0] in (0, 1)


def test_greedy_rule_keeps_the_matching_prefix():
    logits = mx.zeros((3, 4, 8))
    best = [[5, 6, 7, 1], [5, 6, 7, 1], [2, 2, 2, 2]]
    for b, row in enumerate(best):
        for j, t in enumerate(row):
            logits[b, j, t] = 1.0
    v = accept_greedy(logits, [[5, 6, 7], [5, 0, 7], []])
    assert v.accepted == [3, 1, 0]
    assert v.tokens == [[5, 6, 7, 1], [5, 6], [2]]


def test_stats_histogram_and_rates():
    s = SpecStats(4)
    s.record([4, 2, 0], [4, 1, 0], width=5)
    j = s.to_json()
    assert j["accepted_histogram"] == [0, 1, 0, 0, 1] and j["drafted_tokens"] == 6 and j["accepted_tokens"] == 5
    assert j["verified_tokens"] == 9 and j["padded_positions"] == 6 and j["tokens_per_step"] == round(8 / 3, 3)


# --- prompt lookup -------------------------------------------------------------------------
def test_prompt_lookup_matches_the_longest_suffix():
    ctx = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert lookup(ctx, 3, max_ngram=3) == [7, 8, 2]  # latest full match of (2, 3, 4)
    assert lookup(ctx, 12, max_ngram=3) == [7, 8, 2, 3, 4]  # no full run of 12: the latest
    assert lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup([5, 5], 3) == [5]
    assert lookup(ctx, 0) == []


# --- rollback in the caches ----------------------------------------------------------------
def _kv(n, seed):
    mx.random.seed(seed)
    return mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8))


@pytest.mark.parametrize("spare", [0, 5])
def test_window_spare_keeps_rollback_possible_after_single_token_updates(spare):
    """A window drops old tokens in TRIM_STEP steps: right after a drop only spare + 1 tokens
    can be rolled back; without spare a speculative rollback fails loudly, never silently."""
    c = CompressedKVCache(FULL, window=8, keep=2, spare=spare)
    batch = BatchCompressedKVCache([c])
    failed = False
    for step in range(300):
        for i in range(6):  # one round: 6 single-token updates (draft-like), then roll back 5
            c.update_and_fetch(*_kv(1, step * 6 + i))
        try:
            trim_rows([batch], [5])
        except RollbackError:
            failed = True
            break
    assert failed == (spare == 0)
    if spare:
        assert c.offset == 300 and c.size() < 8 + 128 + spare + 6  # still bounded


def test_partial_rollback_of_a_freshly_encoded_block_is_exact():
    """Token-grouped codec (block 32): an update completes a block, a rollback cuts into it;
    the kept tokens come back dense and exact, not decoded from the quantized block."""
    c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    k, v = _kv(40, 0)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    assert c.enc.n == 0 and c.tail.n == 30
    c.update_and_fetch(k[:, :, 30:36], v[:, :, 30:36])  # completes block [0, 32)
    assert c.enc.n == 1
    assert c.trim(5) == 5  # back to 31 tokens: inside the encoded block
    tk, tv = c.tail.get()
    assert c.offset == 31 and c.enc.n == 0
    assert mx.array_equal(tk, k[:, :, :31]).item() and mx.array_equal(tv, v[:, :, :31]).item()
