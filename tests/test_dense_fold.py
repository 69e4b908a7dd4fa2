"""Full-precision batch decode with the query heads of a KV head folded into the query length
(kvcore/attention/dense_fold.py): the same attention as MLX's one-query call, masked or not, and the
same tokens as each row alone when the engine's batch takes it."""

import mlx.core as mx
import pytest

from kvcore.attention import dense_fold
from kvcore.backend import backend_name
from kvcore.cache.dense_batch import DenseBatchKVCache
from mlx_lm.models.cache import KVCache
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.engine import generate_one
from test_dense_batch import llama, run_watching  # noqa: F401 - the module's model fixture

from kvcore.engine import Request


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,L", [(3, 8, 2, 37), (2, 32, 8, 300), (4, 4, 1, 64)])
def test_fold_is_the_same_attention(masked, B, Hq, Hkv, L):
    D = 64
    k0, k1, k2 = mx.random.split(mx.random.key(B * L), 3)
    q = mx.random.normal((B, Hq, 1, D), key=k0)
    keys = mx.random.normal((B, Hkv, L + 9, D), key=k1)[:, :, :L]  # a slice of a larger buffer, as caches hand it
    values = mx.random.normal((B, Hkv, L + 9, D), key=k2)[:, :, :L]
    mask = None
    if masked:  # a padded batch's left padding: row b sees columns [b, L)
        mask = mx.arange(L)[None, None, None, :] >= mx.arange(B)[:, None, None, None]
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask)
    out = dense_fold.attention(q, keys, values, D ** -0.5, mask)
    assert out.shape == ref.shape
    assert mx.abs(out - ref).max().item() < 1e-5


def test_fold_declines_what_it_does_not_cover(monkeypatch):
    monkeypatch.setenv("MLXKV_DENSE_FOLD", "force")
    q = mx.zeros((2, 8, 1, 16))
    k = mx.zeros((2, 2, 10, 16))
    assert not dense_fold.applies(mx.zeros((2, 8, 3, 16)), k, None, None)  # several queries a row
    assert not dense_fold.applies(mx.zeros((2, 2, 1, 16)), k, None, None)  # no grouped heads
    assert not dense_fold.applies(q, k, "causal", None)
    assert not dense_fold.applies(q, k, None, mx.zeros((8,)))  # sinks
    assert not dense_fold.applies(q, k, mx.zeros((2, 8, 1, 10), mx.bool_), None)  # a mask per query head
    assert dense_fold.applies(q, k, None, None)
    batch = DenseBatchKVCache([0, 0])
    padded = mx.ones((2, 1, 1, 10), mx.bool_)
    cpu, cuda = backend_name() == "cpu", backend_name() == "cuda"
    # CUDA folds padded rows alone (an array mask) and only when asked: rows of one length take MLX's cuDNN decode
    for setting, on, on_padded in (("1", cpu, cpu or cuda), ("", cpu, cpu), ("0", False, False)):
        monkeypatch.setenv("MLXKV_DENSE_FOLD", setting)
        assert dense_fold.applies(q, k, None, None, batch) is on, setting
        assert dense_fold.applies(q, k, padded, None, batch) is on_padded, setting
        assert not dense_fold.applies(q, k, None, None, KVCache())  # a lone row / mlx-lm's cache: mlx-lm's call


@pytest.mark.skipif(backend_name() == "metal", reason="the fold is off on Metal")
def test_batched_rows_through_the_fold_match_rows_alone(llama, monkeypatch):
    model, tok = llama
    calls = []
    fold = dense_fold.attention
    monkeypatch.setattr(dense_fold, "attention", lambda *a: calls.append(a[0].shape) or fold(*a))
    policy = resolve_policy(KVOptions())
    reqs = [Request(tuple(3 + (7 * i + j) % 200 for j in range(12)), 10, str(i)) for i in range(3)]
    reqs.append(Request(tuple(range(3, 20)), 6, "long"))  # joins with another length: the array mask
    monkeypatch.setenv("MLXKV_DENSE_FOLD", "0")
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    assert not calls
    monkeypatch.setenv("MLXKV_DENSE_FOLD", "1")  # the CPU's default; CUDA's opt-in
    out, seen, engine = run_watching(model, tok, policy, 4, reqs)
    assert [c.token_ids for c in out] == alone
    assert (4, True) in seen and any(s[0] == 4 for s in calls)  # the padded batch of 4 went through the fold
    assert engine.attention_stats.folded == len(calls)  # counted where bench reports its path
    assert engine.attention_stats.to_json()["path"] == "mlx-fast-sdpa-folded"


@pytest.mark.parametrize("lengths", [(30, 30), (5, 30)], ids=["uniform", "padded"])
def test_packed_rows_decoded_to_dense_fold_and_match_each_row(monkeypatch, lengths):
    """kvcore's own dense decode call (packed rows, portable path): through the fold where it runs, the same
    output as each row's own attention against the float32 reference."""
    from kvcore.attention import blockwise
    from kvcore.attention.config import AttentionConfig
    from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
    from kvcore.codecs import CodecSpec

    monkeypatch.setenv("MLXKV_DENSE_FOLD", "force")
    calls = []
    fold = dense_fold.attention
    monkeypatch.setattr(dense_fold, "attention", lambda *a: calls.append(1) or fold(*a))
    mx.random.seed(3)
    cfg = AttentionConfig(qmm=False, cuda_kernel=False, paged=False)
    rows = []
    for n in lengths:
        c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, attention=cfg)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(c)
    batch = BatchCompressedKVCache(rows)
    view, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    q = mx.random.normal((2, 6, 1, 64))
    out = blockwise.packed_attention(q, view, 0.125, None, cfg)
    assert calls
    k, v = view.dense(0, view.length, q.dtype)
    mask = view.visible(0, view.length)
    ref = blockwise.reference_attention(q, k, v, 0.125, None if view.uniform else mask)
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_fold_over_whole_buffers_is_the_same_attention(kind):
    """The fold over a batch cache's whole buffers (CUDA's form: fixed shapes for 256 steps), the tail masked off,
    equals MLX's call over the rows' own tokens."""
    from mlx_lm.models.cache import KVCache

    rows = []
    for i, n in enumerate((40, 300, 7)):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 32), key=mx.random.key(i)),
                           mx.random.normal((1, 2, n, 32), key=mx.random.key(10 + i)))
        rows.append(c)
    cache = DenseBatchKVCache.merge(rows)
    mask = cache.make_mask(1, return_array=True) if kind != "none" else None  # as a model makes it: before the update
    keys, values = cache.update_and_fetch(mx.random.normal((3, 2, 1, 32)), mx.random.normal((3, 2, 1, 32)))
    assert cache.keys.shape[2] == 512 and keys.shape[2] == 301
    if kind == "additive":
        mask = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    q = mx.random.normal((3, 8, 1, 32))
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)
    k2, v2, m2 = dense_fold.whole_buffers(cache, keys, values, mask)
    assert k2.shape[2] == m2.shape[-1] == 512
    out = dense_fold.attention(q, k2, v2, 0.2, m2)
    assert mx.abs(out - ref).max().item() < 1e-5
    assert dense_fold.whole_buffers(cache, keys[:, :, :300], values[:, :, :300], None)[0].shape[2] == 300  # not its slice


@pytest.mark.skipif(backend_name() == "metal", reason="the fold is off on Metal")
def test_batched_rows_over_whole_buffers_match_rows_alone(llama, monkeypatch):
    """The engine's padded and unpadded batch rows through the fold over whole buffers (what CUDA's opt-in runs)."""
    model, tok = llama
    policy = resolve_policy(KVOptions())
    reqs = [Request(tuple(3 + (5 * i + j) % 150 for j in range(9 + 4 * i)), 12, str(i)) for i in range(3)]
    monkeypatch.setenv("MLXKV_DENSE_FOLD", "0")
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    calls = []
    whole = dense_fold.whole_buffers
    monkeypatch.setattr(dense_fold, "whole_buffers", lambda c, *a: calls.append(c.keys.shape[2]) or whole(c, *a))
    monkeypatch.setenv("MLXKV_DENSE_FOLD", "force")
    out, seen, _ = run_watching(model, tok, policy, 3, reqs)
    assert [c.token_ids for c in out] == alone
    assert (3, True) in seen and calls and all(n % 256 == 0 for n in calls)
