"""Full-precision batch rows of one length decode with no mask (the fused kernel's case) and
give the same tokens as each row alone; a row of another length brings the mask back."""

import pytest

from helpers import per_family
from kvcore.cache.dense_batch import DenseBatchKVCache
from kvcore.engine import Engine, GenerateConfig, Request, generate_one
from kvcore.policy import KVOptions, build_caches, resolve_policy


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (model, tok))("llama")


def test_equal_rows_need_no_mask_and_match_alone(llama):
    model, tok = llama
    policy = resolve_policy(KVOptions())
    reqs = [Request(tuple(3 + (7 * i + j) % 200 for j in range(12)), 10, str(i)) for i in range(3)]
    reqs.append(Request(tuple(range(3, 20)), 6, "long"))  # joins later: its own length
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    out, seen, _ = run_watching(model, tok, policy, 4, reqs)
    assert [c.token_ids for c in out] == alone
    assert (4, True) in seen  # rows of different lengths: the array mask
    out, seen, _ = run_watching(model, tok, policy, 3, reqs[:3])
    assert [c.token_ids for c in out] == alone[:3]
    assert (3, False) in seen  # one length: no mask at all


def run_watching(model, tok, policy, batch, reqs):
    """(completions, {(running rows, padded)} seen at each decode step of a full-precision batch, the engine)."""
    engine = Engine(model, tok, policy, batch, GenerateConfig(prefill_chunk=8), interleave=False)
    seen = set()
    step = engine._decode_step

    def spy():
        c = engine.caches[0]
        if isinstance(c, DenseBatchKVCache):
            seen.add((len(engine.running), c.padded))
        return step()

    engine._decode_step = spy
    return engine.run(reqs), seen, engine


def _rows(lengths, H=2, D=8, dtype=None):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for i, n in enumerate(lengths):
        c = KVCache()
        if n:
            k = mx.random.normal((1, H, n, D), key=mx.random.key(i))
            c.update_and_fetch(k, k + 1)
        out.append(c)
    return out


def _same(mine, theirs):
    import mlx.core as mx

    (k, v), (k2, v2) = mine.keys_and_values(), theirs.keys_and_values()
    assert mine._idx == theirs._idx and k.shape == k2.shape
    assert mx.array_equal(k, k2).item() and mx.array_equal(v, v2).item()
    assert mine.left_padding.tolist() == theirs.left_padding.tolist()
    assert mine.offset.tolist() == theirs.offset.tolist()
    assert mine.keys.shape[2] % 256 == 0 and mine.values.shape[2] % 256 == 0  # whole steps (MLX's cuDNN decode)


@pytest.mark.parametrize("lengths", [(5, 300, 17), (256, 256), (1,), (0, 40)])
def test_buffers_hold_whole_steps_and_the_same_tokens(lengths):
    """Merged, grown across a step, shrunk by a leaving row and joined: mlx-lm's tokens, in buffers of whole steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    mine, theirs = DenseBatchKVCache.merge(_rows(lengths)), BatchKVCache.merge(_rows(lengths))
    _same(mine, theirs)
    B = len(lengths)
    for t in range(260):  # one token a row per step, past the next step boundary
        k = mx.full((B, 2, 1, 8), float(t))
        mine.update_and_fetch(k, -k)
        theirs.update_and_fetch(k, -k)
    _same(mine, theirs)
    if B > 1:  # the longest row leaves: the others' left padding is dropped
        keep = mx.array([i for i in range(B) if lengths[i] != max(lengths)] or [0])
        mine.filter(keep)
        theirs.filter(keep)
        _same(mine, theirs)
    join = _rows((700,))
    mine.extend(DenseBatchKVCache.merge(join))
    theirs.extend(BatchKVCache.merge(_rows((700,))))
    _same(mine, theirs)


def test_the_runner_grows_batch_buffers_before_the_step(llama, monkeypatch):
    """Rows crossing a 256-token step while decoding: the buffers grow before the forward, a layer at a time (never
    inside a step's update), and the tokens are each row's alone."""
    model, tok = llama
    policy = resolve_policy(KVOptions())
    reqs = [Request(tuple(3 + (11 * i + j) % 190 for j in range(250 + 3 * i)), 9, str(i)) for i in range(2)]
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    grown, inside = [], []
    room = DenseBatchKVCache.make_room

    def spy(self, n):
        did = room(self, n)
        (inside if spy.updating else grown).append(did)
        return did

    spy.updating = False
    update = DenseBatchKVCache.update_and_fetch

    def in_update(self, k, v):
        spy.updating = True
        try:
            return update(self, k, v)
        finally:
            spy.updating = False

    monkeypatch.setattr(DenseBatchKVCache, "make_room", spy)
    monkeypatch.setattr(DenseBatchKVCache, "update_and_fetch", in_update)
    out, seen, engine = run_watching(model, tok, policy, 2, reqs)
    assert [c.token_ids for c in out] == alone
    assert any(grown) and not any(inside)  # grew, and only before a forward


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (model, tok))("qwen3")


@pytest.mark.parametrize("rows", [1])
def test_compressed_rows_grow_before_the_step(qwen3, monkeypatch, rows):
    """A compressed layer crossing a 256-token step while decoding grows its buffers before the forward
    (Runner.forward's make_room), never inside a step's update; tokens as alone."""
    import mlx.core as mx

    from kvcore.cache.buffer import Buffer
    from kvcore.cache.packed import PackedRows

    model, tok = qwen3  # head dim 64: affine codes a token at a time (the decode path that appends one)
    policy = resolve_policy(KVOptions(kv="affine:4", quantized_kv_start=0))
    start = 251 if rows == 1 else 500  # packed rows start with a step to spare: (longest + 256) // 256 * 256
    reqs = [Request(tuple(3 + (13 * i + j) % 180 for j in range(start + 2 * i)), 9, str(i)) for i in range(rows)]
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    where = {"update": 0}
    grown = []  # (inside an update?) for every growth of a decode step's buffers

    def flagged(fn):
        def run(self, *a, **k):
            where["update"] += 1
            try:
                return fn(self, *a, **k)
            finally:
                where["update"] -= 1
        return run

    room, pad = Buffer._room, mx.pad

    def spy_room(self, k, *a):
        if self.parts is not None:  # growth of a buffer in use (not its first allocation)
            grown.append(where["update"] > 0)
        return room(self, k, *a)

    monkeypatch.setattr(Buffer, "_room", spy_room)
    monkeypatch.setattr(Buffer, "append", flagged(Buffer.append))
    monkeypatch.setattr(PackedRows, "update_and_fetch", flagged(PackedRows.update_and_fetch))
    packed_room = PackedRows.make_room

    def spy_packed(self, n):
        did = packed_room(self, n)
        if did:
            grown.append(where["update"] > 0)
        return did

    monkeypatch.setattr(PackedRows, "make_room", spy_packed)
    engine = Engine(model, tok, policy, rows, GenerateConfig(prefill_chunk=64), interleave=False)
    out = engine.run(reqs)
    assert [c.token_ids for c in out] == alone
    assert grown and not any(grown), grown  # grew, and only before a forward


def test_packed_rows_make_room_before_their_update():
    """Packed rows (BatchCompressedKVCache.make_room): grown by whole steps when the next tokens would not fit, once,
    and the update then writes without growing."""
    import mlx.core as mx

    from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
    from kvcore.codecs import CodecSpec

    from kvcore.attention.config import AttentionConfig

    rows = []
    for i, n in enumerate((250, 255, 240)):
        c = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, attention=AttentionConfig(paged=False))
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(i))
        c.update_and_fetch(k, k)
        rows.append(c)
    batch = BatchCompressedKVCache(rows)
    batch._maybe_pack()
    cap = batch.packed.parts[0].shape[2]
    assert cap % 256 == 0 and cap > max(batch.packed.lengths) and not batch.make_room(1)
    lengths = list(batch.packed.lengths)
    grew = []
    for step in range(cap - max(lengths) + 2):
        grew.append(batch.make_room(1))
        before = batch.packed.parts[0].shape[2]
        batch.update_and_fetch(mx.zeros((3, 2, 1, 64)), mx.zeros((3, 2, 1, 64)))
        assert batch.packed.parts[0].shape[2] == before  # the update found room
    assert grew.count(True) == 1 and batch.packed.parts[0].shape[2] == cap + 256


def test_a_full_precision_row_grows_before_the_step(llama, monkeypatch):
    """A lone full-precision row (mlx-lm's KVCache) crossing a 256-token step grows in the runner's pass before the
    forward, as its own update would have grown it (kvcore/cache/room.py): no update changes its capacity, and the
    tokens are those of the row decoded on its own."""
    from mlx_lm.models.cache import KVCache

    model, tok = llama
    policy = resolve_policy(KVOptions())
    req = Request(tuple(3 + (7 * j) % 170 for j in range(252)), 10, "0")
    alone = generate_one(model, tok, req, build_caches(model, policy)[0]).token_ids
    changed, seen = [], []
    update = KVCache.update_and_fetch

    def spy(self, k, v):
        before = None if self.keys is None else self.keys.shape[2]
        out = update(self, k, v)
        seen.append(before)
        changed.append(before is not None and self.keys.shape[2] != before)
        return out

    monkeypatch.setattr(KVCache, "update_and_fetch", spy)
    out = Engine(model, tok, policy, 1, GenerateConfig(prefill_chunk=64), interleave=False).run([req])
    assert out[0].token_ids == alone
    assert 256 in seen and 512 in seen and not any(changed)  # crossed a step, grown before the updates
