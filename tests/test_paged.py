"""Paged batch rows (kvcore/cache/paged.py, kvcore/attention/paged.py): the same attention as packed
rows through joins, leaves and multi-query steps, for every packable codec; a join or a leave does
not copy the rows already there; a row comes back out as it went in."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention.config import AttentionConfig
from kvcore.attention.hook import _sdpa
from kvcore.backend import backend_name
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.cache.paged import PAGE, PagedRows
from kvcore.codecs import CodecSpec

SPECS = {"affine4": CodecSpec("affine", 4, 32), "affine8": CodecSpec("affine", 8, 64), "turbo3": CodecSpec("turbo", 3),
         "full": CodecSpec("full", None, None)}


def _row(spec, n, dtype, paged, H=2, D=64):
    c = CompressedKVCache(spec, start=0, attention=AttentionConfig(paged=paged))
    c.update_and_fetch(mx.random.normal((1, H, n, D)).astype(dtype), mx.random.normal((1, H, n, D)).astype(dtype))
    return c


def _run(spec, dtype, paged):
    """Attention outputs of a batch through steps, a leave, a join and a 3-query step."""
    mx.random.seed(0)
    batch = BatchCompressedKVCache([_row(spec, n, dtype, paged) for n in (5, 300, 130)])
    outs, kinds = [], set()
    for step in range(6):
        if step == 2:
            batch.filter([0, 2])
        if step == 3:
            batch.extend(BatchCompressedKVCache([_row(spec, 2 * PAGE, dtype, paged)]))  # ends on a page edge
        B, N = batch.batch_size, 3 if step == 5 else 1
        view, _ = batch.update_and_fetch(*(mx.random.normal((B, 2, N, 64)).astype(dtype) for _ in range(2)))
        kinds.add(type(batch.packed).__name__)
        q = mx.random.normal((B, 8, N, 64)).astype(dtype)
        sinks = mx.random.normal((8,)).astype(dtype) if step % 2 else None
        outs.append(np.array(_sdpa(q, view, view, batch, 0.125, None, sinks=sinks).astype(mx.float32)))
    return outs, kinds, batch


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_paged_rows_attend_as_packed_rows(name, dtype):
    paged, kinds, batch = _run(SPECS[name], dtype, True)
    packed, kinds_p, _ = _run(SPECS[name], dtype, False)
    assert kinds == {"PagedRows"} and kinds_p == {"PackedRows"}
    tol = 3e-2 if dtype == mx.bfloat16 else 2e-5
    for step, (a, b) in enumerate(zip(paged, packed)):
        assert np.allclose(a, b, atol=tol, rtol=tol), (name, step)
    assert batch.packed.lengths == [5 + 6 + 2, 130 + 6 + 2, 2 * PAGE + 3 + 2]
    calls = batch.packed.template.stats.calls
    if name.startswith("affine") and backend_name() != "cuda":  # read in place (gather_qmm) on CPU and Metal
        assert calls.get("qmm") == 6
    assert sum(calls.values()) == 6  # CUDA: the kernel from cuda_min_tokens, the gathered rows below it


def test_a_join_and_a_leave_copy_none_of_the_other_rows():
    """The rows already paged keep their pages (the same page ids, the same bytes); a join writes
    only the new row's pages; a leave frees pages without touching the pool."""
    mx.random.seed(1)
    spec = SPECS["affine4"]
    batch = BatchCompressedKVCache([_row(spec, n, mx.float32, True, H=8, D=128) for n in (3000, 2000)])
    batch.update_and_fetch(*(mx.random.normal((2, 8, 1, 128)) for _ in range(2)))
    rows = batch.packed
    rows.reserve(64, exact=True)  # the engine reserves the final lengths when a row joins
    mx.eval(rows.pool)
    tables = [list(t) for t in rows.tables]
    before = [np.array(p[mx.array(tables[0] + tables[1])]) for p in rows.pool]
    new = _row(spec, 200, mx.float32, True, H=8, D=128)
    mx.eval(new.state)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    batch.extend(BatchCompressedKVCache([new]))
    mx.eval(rows.pool)
    grew = mx.get_peak_memory() - base
    assert grew < 0.1 * rows.allocated  # no copy of the pool: the new row's pages, written in place
    assert rows.tables[:2] == tables and len(rows.tables) == 3
    after = [np.array(p[mx.array(tables[0] + tables[1])]) for p in rows.pool]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    free = len(rows.free)
    pool = rows.pool
    batch.filter([0, 2])
    assert rows.pool is pool and len(rows.free) == free + len(tables[1])


def test_paged_rows_unpack_to_the_rows_they_were():
    mx.random.seed(2)
    spec = SPECS["affine4"]
    rows = [_row(spec, n, mx.float32, True) for n in (1, PAGE - 1, PAGE, 3 * PAGE + 7)]
    want = [tuple(np.array(a) for a in r.state) for r in rows]
    paged = PagedRows.pack(rows)
    assert paged is not None and [len(t) for t in paged.tables] == [1, 1, 2, 4]
    back = paged.unpack()
    for r, w in zip(back, want):
        assert all(np.array_equal(np.array(a), b) for a, b in zip(r.state, w))


def test_rows_not_in_pages_on_cuda_by_default(monkeypatch):
    import kvcore.backend as kb

    assert AttentionConfig(paged=True).pages and not AttentionConfig(paged=False).pages
    monkeypatch.setattr(kb, "_backend", lambda cpu: "cuda")  # the kernel reads packed rows (for now)
    assert not AttentionConfig().pages
    monkeypatch.setattr(kb, "_backend", lambda cpu: "metal")
    assert AttentionConfig().pages


def test_rows_with_a_common_prompt_prefix_share_its_pages(tiny_models):
    """Three prompts with a 300-token common prefix in one paged batch: the prefix's two whole
    pages are held once (their bytes are each row's own), and every row's tokens equal the row
    generated alone."""
    from mlx_lm import load

    from kvcore.engine import Engine, GenerateConfig, Request, generate_one
    from kvcore.policy import KVOptions, build_caches, resolve_policy

    model, tok = load(str(tiny_models("qwen3")))
    policy = resolve_policy(KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0))
    prefix = [(7 * t) % 90 + 3 for t in range(2 * PAGE + 44)]
    reqs = [Request(tuple(prefix + [10 + i, 20 + i, 30 + i]), 6, str(i)) for i in range(3)]
    cfg = GenerateConfig(prefill_chunk=64)
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0], cfg).token_ids for r in reqs]
    engine = Engine(model, tok, policy, 3, cfg, interleave=False, attention=AttentionConfig(paged=True),
                    ignore_eos=True)
    for r in reqs:
        engine.add_request(r)
    while len(engine.running) < 3:
        engine.step()
    for c in engine.caches:
        rows = c.packed
        assert isinstance(rows, PagedRows)
        assert rows.tables[0][:2] == rows.tables[1][:2] == rows.tables[2][:2]
        assert rows.pages_used == sum(len(t) for t in rows.tables) - 4  # 2 pages held once, not 3 times
    while engine.has_work:
        engine.step()
    assert [engine.done[r.id].token_ids for r in reqs] == [a[: len(engine.done[r.id].token_ids)] for a in alone]
    assert all(len(engine.done[r.id].token_ids) == 6 for r in reqs)


def test_a_row_writing_into_a_shared_page_gets_its_own_copy():
    """Copy on write: rows sharing a prefix page, one rolled back into it and written on: the other
    rows read what they read before, the written row reads its new tokens (== unshared rows)."""
    mx.random.seed(4)
    spec = SPECS["affine4"]
    k0, v0 = (mx.random.normal((1, 2, 2 * PAGE, 64)) for _ in range(2))

    def rows():
        out = []
        for extra in (5, 9):
            c = CompressedKVCache(spec, start=0, attention=AttentionConfig(paged=True))
            c.update_and_fetch(mx.concatenate([k0, mx.random.normal((1, 2, extra, 64), key=mx.random.key(extra))], 2),
                               mx.concatenate([v0, mx.random.normal((1, 2, extra, 64), key=mx.random.key(extra + 1))], 2))
            out.append(c)
        return out

    ids = [list(range(2 * PAGE)) + [1000 + j for j in range(e)] for e in (5, 9)]
    shared, plain = PagedRows.pack(rows(), ids), PagedRows.pack(rows())
    assert shared.tables[0][:2] == shared.tables[1][:2] and shared.refs
    assert plain.tables[0][:2] != plain.tables[1][:2]
    for r in (shared, plain):
        assert r.trim_rows([2 * PAGE + 5 - (PAGE + 10), 0]) == [PAGE - 5, 0]  # row 0 back into page 1
    q = mx.random.normal((2, 4, 1, 64))
    for step in range(3):
        new = [mx.random.normal((2, 2, 1, 64), key=mx.random.key(50 + step + j)) for j in range(2)]
        a, b = shared.update_and_fetch(*new), plain.update_and_fetch(*new)
        got, want = _sdpa(q, a, a, None, 0.125, None), _sdpa(q, b, b, None, 0.125, None)
        assert np.allclose(np.array(got), np.array(want), atol=1e-5), step
    assert shared.tables[0][1] != shared.tables[1][1] and shared.tables[0][0] == shared.tables[1][0]


def test_same_ids_with_other_bytes_share_nothing():
    """Ids only name candidates: rows whose prefix ids agree but whose K/V differ (another adapter,
    another model state) keep their own pages."""
    mx.random.seed(5)
    spec = SPECS["affine4"]
    rows = [_row(spec, 2 * PAGE + 3, mx.float32, True) for _ in range(2)]
    ids = [list(range(2 * PAGE + 3))] * 2
    paged = PagedRows.pack(rows, ids)
    assert not paged.refs and set(paged.tables[0]).isdisjoint(paged.tables[1])
    twin = PagedRows.pack([rows[0], rows[0]], ids)  # the same bytes: shared
    assert twin.tables[0][:2] == twin.tables[1][:2] and len(twin.refs) == 2


def test_a_departed_rows_prefix_pages_are_taken_back_and_forgotten_once_rewritten():
    """A row's indexed pages outlive it: a later row with the same prefix (ids and bytes) takes them back
    instead of writing its own, and reads what an unshared copy reads; once a page is taken for new bytes,
    nothing in the index names it."""
    mx.random.seed(6)
    spec = SPECS["affine4"]
    k0, v0 = (mx.random.normal((1, 2, 2 * PAGE, 64)) for _ in range(2))

    def row(extra, seed, prefix=True):
        ks = [k0] if prefix else [mx.random.normal((1, 2, 2 * PAGE, 64), key=mx.random.key(seed + 99))]
        vs = [v0] if prefix else [mx.random.normal((1, 2, 2 * PAGE, 64), key=mx.random.key(seed + 98))]
        c = CompressedKVCache(spec, start=0, attention=AttentionConfig(paged=True))
        c.update_and_fetch(mx.concatenate(ks + [mx.random.normal((1, 2, extra, 64), key=mx.random.key(seed))], 2),
                           mx.concatenate(vs + [mx.random.normal((1, 2, extra, 64), key=mx.random.key(seed + 1))], 2))
        return c

    def ids(extra):
        return list(range(2 * PAGE)) + [1000 + j for j in range(extra)]

    rows = PagedRows.pack([row(5, 1), row(9, 2, prefix=False)], [ids(5), None])
    old = rows.tables[0][:2]
    rows.filter([1])  # the first row leaves: its pages are free, still indexed
    assert set(old) <= set(rows.free)
    rows.reserve(8, exact=True)
    rows.join([row(1, 5, prefix=False)])  # a row without ids first: it takes fresh pages, not the freed ones
    free = len(rows.free)
    rows.join([row(7, 3)], [ids(7)])
    assert rows.tables[2][:2] == old and not rows.refs  # taken back, one owner again
    assert len(rows.free) == free - len(rows.tables[2])  # its 2 old pages and its 1 own
    plain = PagedRows.pack([row(9, 2, prefix=False), row(1, 5, prefix=False), row(7, 3)])
    q = mx.random.normal((3, 4, 1, 64))
    new = [mx.random.normal((3, 2, 1, 64), key=mx.random.key(60 + j)) for j in range(2)]
    a, b = rows.update_and_fetch(*new), plain.update_and_fetch(*new)
    assert np.allclose(np.array(_sdpa(q, a, a, None, 0.125, None)), np.array(_sdpa(q, b, b, None, 0.125, None)),
                       atol=1e-5)
    rows.filter([0, 1])  # the prefix row leaves again; a long row without ids takes every free page
    rows.join([row(len(rows.free) * PAGE - 3 * PAGE, 4, prefix=False)])
    assert not rows.free and not set(rows.index.values()) & set(rows.tables[2])
