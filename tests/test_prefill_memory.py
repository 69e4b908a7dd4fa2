"""Peak memory of a prefill: weights + compressed KV + one layer's bounded transient (CPU, measured
with mx.get_peak_memory), for one attention call and for a whole chunked prefill of a tiny model;
the same runs with an unbounded scratch (the old path) exceed the bound."""

import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvcore.attention import kv_attention
from kvcore.attention.config import AttentionConfig
from kvcore.attention.prefill import plan_call
from kvcore.attention.scratch import CallShape
from kvcore.backend import backend_name
from kvcore.cache import CompressedKVCache
from kvcore.cache.bytes import KVByteModel
from kvcore.codecs import CodecSpec
from kvcore.engine.forward import prefill
from kvcore.policy import KVPolicy, build_caches
from kvcore.policy.plan import plan_layers
from kvcore.transient import plan_prefill

# the planned factors (decode workspace, unfused SDPA scores, run-ahead) were measured against MLX's
# CPU allocator; on a GPU, scripts/gpu_bench.py holds the measured peak against the plan
pytestmark = pytest.mark.skipif(backend_name() != "cpu", reason="bounds measured on MLX's CPU backend")

A4, T4, T3 = CodecSpec("affine", 4, 64), CodecSpec("turbo", 4), CodecSpec("turbo", 3)
CALLS = {
    # name: (key, value, head_dim, start, window, keep, recent)
    "affine4": (A4, A4, 64, 0, None, 0, 0),
    "turbo-k4v3": (T4, T3, 64, 0, None, 0, 0),
    "affine4-recent": (A4, A4, 64, 0, None, 0, 16),
    "affine4-window": (A4, A4, 64, 0, 900, 4, 0),
    "affine3-token-layout": (CodecSpec("affine", 3, 32), CodecSpec("affine", 3, 32), 48, 0, None, 0, 0),
    "dense-before-start": (A4, A4, 64, 1 << 20, None, 0, 0),
}
PAST, N, HQ, HKV = 768, 256, 8, 2


def _peak_of(fn) -> int:
    """Bytes allocated beyond what was live before `fn`'s result is evaluated."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


def _view(case, limit):
    kspec, vspec, hd, start, window, keep, recent = CALLS[case]
    mx.random.seed(0)
    cache = CompressedKVCache(kspec, vspec, start=start, window=window, keep=keep, recent=recent,
                              attention=AttentionConfig(scratch_bytes=limit))
    cache.update_and_fetch(mx.random.normal((1, HKV, PAST, hd)), mx.random.normal((1, HKV, PAST, hd)))
    mx.eval(cache.state)
    k, v, q = mx.random.normal((1, HKV, N, hd)), mx.random.normal((1, HKV, N, hd)), mx.random.normal((1, HQ, N, hd))
    view, _ = cache.update_and_fetch(k, v)
    mx.eval(q, cache.state)  # the cache update is not the call's transient
    return q, view, hd


@pytest.mark.parametrize("case", list(CALLS))
def test_one_call_stays_within_its_planned_bytes(case):
    q, view, hd = _view(case, None)
    shape = CallShape.of(q.shape, q.dtype, view)
    whole = plan_call(shape, q.dtype, 1 << 40)
    limit = whole.bytes.total - whole.bytes.scores // 2  # groups of about an eighth of the queries (4 in flight)
    bounded = plan_call(shape, q.dtype, limit)
    assert bounded is not None and bounded.group < N  # query groups
    q, view, hd = _view(case, limit)
    used = _peak_of(lambda: kv_attention(q, view, hd**-0.5))
    assert used <= bounded.bytes.total <= limit, (used, bounded.bytes.to_json())
    assert view.stats.calls == {"fused": 1}
    # negative control: the same call, unbounded (one call, as before this budget existed)
    q, view, hd = _view(case, 1 << 40)
    assert _peak_of(lambda: kv_attention(q, view, hd**-0.5)) > limit


TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def tiny():
    arch = importlib.import_module("mlx_lm.models.llama")
    model = arch.Model(arch.ModelArgs.from_dict(TINY))
    mx.eval(model.parameters())
    return model, sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _allocated(caches) -> int:
    return sum(p.nbytes for c in caches for b in (c.sink, c.enc, c.tail) if b.parts for p in b.parts)


@pytest.mark.parametrize("kv,recent", [("affine", 0), ("turbo", 0), ("affine", 16)])
def test_prefill_peak_is_weights_plus_kv_plus_one_layer_transient(tiny, kv, recent):
    model, weights = tiny
    context = 1024
    spec = A4 if kv == "affine" else T4
    policy = KVPolicy(codec=spec, start=0, recent=recent)
    kv_bytes = KVByteModel(TINY, plan_layers(model, policy), 4, chunk=context).row_bytes(context)
    budget = weights + kv_bytes + 12 * 2**20
    plan = plan_prefill(TINY, policy, context, weights, kv_bytes, budget, dtype_size=4)
    assert MIN_CHUNK <= plan.chunk < context and plan.peak <= budget and plan.transient.group > 0
    tokens = mx.random.randint(0, 256, (context,), key=mx.random.key(3)).tolist()

    def run(attention, chunk):
        caches, _ = build_caches(model, policy, attention)
        # what the run adds beyond what was live before it (other tests may leave arrays alive), plus
        # the weights, which were live before it too: comparable to weights + KV + transient
        used = _peak_of(lambda: prefill(model, tokens, caches, chunk)) + weights
        return used, caches

    peak, caches = run(plan.attention, plan.chunk)
    kv_alloc = _allocated(caches)
    assert kv_alloc - sum(c.nbytes for c in caches) <= len(caches) * 512 * 16  # reserved once: no growth spare
    bound = weights + kv_alloc + plan.transient.total
    assert peak <= bound <= budget, (peak, bound, plan.to_json())
    assert "blockwise" not in caches[0].stats.calls
    # negative control: the old path (unbounded scratch, the old 512-token default chunk)
    unbounded, _ = run(AttentionConfig(scratch_bytes=1 << 40), 512)
    assert unbounded > bound, (unbounded, bound)


MIN_CHUNK = 64


@pytest.mark.parametrize("spec", [T4, CodecSpec("affine", 4, 32)], ids=["turbo", "affine-token-layout"])
def test_conversion_encodes_in_pieces(spec):
    """Converting a long dense layer encodes it a piece at a time: the same stored blocks as one
    encode call, a fraction of its working memory (turbo's float32 rotation and indices)."""
    mx.random.seed(4)
    k, v = mx.random.normal((1, 2, 3000, 48)), mx.random.normal((1, 2, 3000, 48))
    caches, peaks = [], []
    for piece in (512, 1 << 20):
        c = CompressedKVCache(spec, start=1 << 20, recent=8)
        c.update_and_fetch(k, v)
        mx.eval(c.state)
        c.start = 0  # the conversion start is reached: convert all 3000 tokens at once
        peaks.append(_peak_of(lambda c=c, piece=piece: (c.convert(piece), c.state)[1]))
        caches.append(c)
    a, b = caches
    assert (a.enc.n, a.tail.n, a.enc_start, a.tail_start) == (b.enc.n, b.tail.n, b.enc_start, b.tail_start)
    for x, y in zip(a.state, b.state):  # codes bit for bit; a norm or scale may round its last bit differently
        if mx.issubdtype(x.dtype, mx.integer):  # (a BLAS's kernels for 512 rows against 3000: one fp16 ulp, in
            assert mx.array_equal(x, y).item()  # 1 of 5 984 turbo norms with OpenBLAS on a Zen CPU)
        else:
            assert mx.allclose(x, y, rtol=2**-10, atol=0).item()
            assert (x != y).sum().item() <= max(1, x.size // 1000)
    assert peaks[0] < 0.6 * peaks[1], peaks
