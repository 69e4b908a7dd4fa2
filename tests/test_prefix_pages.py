"""Serve's prefix cache over paged rows (issue 17, 2b): an entry is the pinned pages of the pools the
rows run in, not a copy. A second prompt sharing the first's prefix takes the same pages back (one set
of pages for both rows and both entries) and returns exactly what it returns prefilled alone; a row
writing into a pinned page copies it first, so the entry still holds the prompt; an evicted entry hands
its pages back to the free ones; the pools outlive an empty batch (and, without a prefix cache, go with
it as before) but give back what no entry pins; a row that cannot page turns the entries into copies."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from kvcore.attention.config import AttentionConfig
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.cache.paged import PAGE
from kvcore.codecs import CodecSpec
from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.policy import KVOptions, resolve_policy
from kvcore.serve.prefix import PrefixCache

CHUNK = 64
KV = KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0)


@pytest.fixture(scope="module")
def lm(tiny_models):
    model, tok = load(str(tiny_models("qwen3")))
    return model, tok, resolve_policy(KV)


def prompt(n: int, seed: int) -> tuple:
    return tuple(int(x) for x in mx.random.randint(3, 200, (n,), key=mx.random.key(seed)).tolist())


PAGED = AttentionConfig(paged=True)  # the CPU and Metal default; CUDA packs its rows unless told


def engine_with(lm, capacity: int = 2**30) -> Engine:
    model, tok, policy = lm
    engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True, attention=PAGED)
    engine.prefix = PrefixCache(capacity, engine.runner.new_caches)
    return engine


def alone(lm, ids: tuple, n: int) -> list[int]:
    """The whole prompt prefilled in its own caches, no prefix cache: a lone row as built."""
    model, tok, policy = lm
    engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True)
    return engine.run([Request(ids, n, "alone")])[0].token_ids


def pools(engine) -> list:
    return [c.paged for c in engine.runner.caches]


def test_entries_are_pinned_pages_and_a_shared_prefix_is_one_set_of_them(lm):
    engine = engine_with(lm)
    a = prompt(2 * PAGE + 40, 0)  # two whole pages and a part
    b = a + prompt(30, 1)
    (ca,) = engine.run([Request(a, 6, "a")])
    assert ca.token_ids == alone(lm, a, 6)
    entry = engine.prefix.entries[(None, a)]
    assert entry.layers is None and entry.pages is not None  # no copy: the pools' pages
    assert engine.runner.pooled and engine.runner.caches[0].batch_size == 0  # the pools outlive the batch
    pool, pages_a, n = entry.pages[0]
    assert n == len(a) and len(pages_a) == 3 and entry.nbytes == sum(len(p) * q.page_bytes for q, p, _ in entry.pages)
    assert all(p in pool.pins and p not in pool.free for p in pages_a)
    allocated = [p.allocated for p in pools(engine)]
    (cb,) = engine.run([Request(b, 6, "b")])
    assert cb.token_ids == alone(lm, b, 6)  # token-exact against the whole prompt prefilled alone
    assert engine.prefix.hits == 1 and engine.prefix.reused == {"b": len(a)}
    pages_b = engine.prefix.entries[(None, b)].pages[0][1]
    assert pages_b[:2] == pages_a[:2] and pages_b[2] != pages_a[2]  # whole pages shared, the part-filled one its own
    assert [p.allocated for p in pools(engine)] == allocated  # nothing new allocated for the shared prompt


def _row(n: int) -> CompressedKVCache:
    c = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, attention=AttentionConfig(paged=True))
    c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    return c


def test_a_row_writing_into_a_pinned_token_copies_its_page_first():
    batch = BatchCompressedKVCache([_row(PAGE + 10), _row(40)])
    step = lambda: batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    step()
    pool = batch.paged
    pages, n = pool.row_pages(0)
    pool.pin(pages, n)  # an entry holds row 0's PAGE + 11 tokens
    held = lambda: [mx.concatenate([p[pages[0]], p[pages[1]][:, : n - PAGE]], axis=1) for p in pool.pool]
    kept = held()
    step()  # row 0 writes slot 11 of its second page, past the pinned tokens: in place
    assert pool.tables[0] == pages
    pool.trim_rows([5, 0])  # rolled back into the pinned tokens: the next write copies the page first
    step()
    assert pool.tables[0][0] == pages[0] and pool.tables[0][1] != pages[1]
    assert all(mx.array_equal(a, b).item() for a, b in zip(held(), kept))  # the entry's tokens as they were
    pool.unpin(pages)
    assert pages[1] in pool.free and pages[0] not in pool.free and not pool.pins  # row 0 still holds page 0


def test_the_same_prompt_again_is_a_hit_and_the_same_tokens(lm):
    engine = engine_with(lm)
    a = prompt(PAGE + 10, 2)
    first = engine.run([Request(a, 4, "a")])[0].token_ids
    (again,) = engine.run([Request(a, 4, "a2")])
    assert engine.prefix.hits == 1 and again.token_ids == first == alone(lm, a, 4)
    (more,) = engine.run([Request(a + (7,), 5, "a3")])
    assert engine.prefix.hits == 2 and more.token_ids == alone(lm, a + (7,), 5)


def test_an_evicted_entry_hands_its_pages_back(lm):
    one = engine_with(lm)
    x, y = prompt(PAGE + 20, 3), prompt(PAGE + 20, 4)  # no shared start
    one.run([Request(x, 2, "x")])
    size = one.prefix.nbytes
    engine = engine_with(lm, int(1.5 * size))
    engine.run([Request(x, 2, "x")])
    pool, pages_x, _ = engine.prefix.entries[(None, x)].pages[0]
    engine.run([Request(y, 2, "y")])
    assert list(engine.prefix.entries) == [(None, y)]  # x evicted
    assert all(p not in pool.pins and p in pool.free for p in pages_x)
    assert engine.prefix.nbytes == size


def test_without_a_prefix_cache_the_pools_go_with_the_batch(lm):
    model, tok, policy = lm
    engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True)
    engine.run([Request(prompt(40, 5), 3, "p")])
    assert engine.runner.caches is None  # a lone row as built, dropped when it ends (unchanged)


def test_a_row_that_cannot_page_turns_the_entries_into_copies(lm):
    """A delayed conversion start: a prompt past it pages, one short of it does not, and joining it takes
    the batch out of pages, so the entries become copies (no entry keeps a pool the rows left)."""
    model, tok, _ = lm
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=200))
    engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True, attention=PAGED)
    engine.prefix = PrefixCache(2**30, engine.runner.new_caches)
    long, short = prompt(PAGE + 150, 6), prompt(40, 7)
    engine.run([Request(long, 3, "long")])
    entry = engine.prefix.entries[(None, long)]
    assert entry.pages is not None
    pool = entry.pages[0][0]
    engine.run([Request(short, 3, "short")])
    assert not engine.runner.pooled and not pool.pins  # the batch left the pools; nothing pins them
    copy = engine.prefix.entries[(None, long)]
    assert copy.pages is None and copy.layers is not None
    assert engine.prefix.nbytes == sum(e.nbytes for e in engine.prefix.entries.values())
    (again,) = engine.run([Request(long + (9,), 4, "again")])
    model_alone = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True)
    assert engine.prefix.hits == 1 and again.token_ids == model_alone.run([Request(long + (9,), 4, "x")])[0].token_ids


def test_an_idle_pool_gives_back_what_no_entry_pins(lm):
    """After a burst of rows the pool holds their decode pages too; once the batch is empty it keeps only the
    pages the entries pin (renumbered), and the entries still restore exactly."""
    model, tok, policy = lm
    engine = Engine(model, tok, policy, 4, GenerateConfig(prefill_chunk=CHUNK), ignore_eos=True, attention=PAGED)
    engine.prefix = PrefixCache(2**30, engine.runner.new_caches, compact_free=0)
    prompts = [prompt(PAGE + 20, 10 + i) for i in range(4)]
    engine.run([Request(p, 400, str(i)) for i, p in enumerate(prompts)])  # 2 pinned pages a row, 5 used
    pool = engine.prefix.entries[(None, prompts[0])].pages[0][0]
    assert not pool.free and sorted(pool.pins) == list(range(8)) and pool.pool[0].shape[0] == 8
    assert pool.allocated == 8 * pool.page_bytes
    (again,) = engine.run([Request(prompts[2] + (5,), 4, "again")])
    assert engine.prefix.hits == 1 and again.token_ids == alone(lm, prompts[2] + (5,), 4)
