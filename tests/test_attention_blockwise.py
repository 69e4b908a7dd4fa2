"""The portable attention path equals reference attention over the dequantized KV."""

import mlx.core as mx
import pytest
from backend_expect import MLX_LM_QUANTIZED_FAILS, QMM_FAILURE, mlx_lm_quantized_attention_error

from kvcore.attention import blockwise, kv_attention, reference_attention
from kvcore.attention.config import AttentionConfig
from kvcore.backend import backend_name
from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec


def _reference(q, view, scale, sinks):
    """Reference: materialize each segment dense and mask by the same positional rule."""
    ks, vs, ms = [], [], []
    for s in view.segments:
        k, v = s.dense(0, s.length, mx.float32)
        ks.append(k)
        vs.append(v)
        ms.append(s.visible(view.q_positions, 0, s.length, view.window, view.keep))
    K, V, M = (mx.concatenate(x, axis=a) for x, a in ((ks, 2), (vs, 2), (ms, 1)))
    return reference_attention(q, K, V, scale, M, sinks)


CASES = [
    # spec, head_dim, window, keep, sinks
    (CodecSpec("affine", 4, 64), 64, None, 0, False),
    (CodecSpec("affine", 8, 32), 8, None, 0, False),
    (CodecSpec("affine", 4, 32), 16, 48, 4, True),
    (CodecSpec("affine", 3, 64), 128, 40, 0, False),
    (CodecSpec("full"), 32, 20, 2, True),
]


@pytest.mark.parametrize("block", [None, 32], ids=["fused", "blockwise"])
@pytest.mark.parametrize("spec,head_dim,window,keep,sinks", CASES)
def test_attention_matches_reference(spec, head_dim, window, keep, sinks, block):
    mx.random.seed(3)  # block 32: several blocks even for short histories
    cache = CompressedKVCache(spec, start=0, window=window, keep=keep, attention=AttentionConfig(block=block))
    Hq, Hkv = 6, 2  # GQA
    sink = mx.random.normal((Hq,)) if sinks else None
    for N in (5, 1, 1, 70, 1, 33, 1, 1, 130, 1):
        k, v = mx.random.normal((2, Hkv, N, head_dim)), mx.random.normal((2, Hkv, N, head_dim))
        q = mx.random.normal((2, Hq, N, head_dim))
        view, _ = cache.update_and_fetch(k, v)
        out = kv_attention(q, view, head_dim**-0.5, sink)
        ref = _reference(q, view, head_dim**-0.5, sink)
        assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item(), (N, mx.abs(out - ref).max().item())


def test_token_layout_view_has_shadow_when_a_chunk_completes_a_block():
    cache = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    view, _ = cache.update_and_fetch(mx.zeros((1, 1, 40, 8)), mx.zeros((1, 1, 40, 8)))
    kinds = [s.kind for s in view.segments]
    assert kinds == ["encoded", "shadow", "dense"]
    q = view.q_positions
    enc, shadow = view.segments[0], view.segments[1]
    # query 10 reads block 0 (positions 0..31) dense; query 31 and later read it encoded
    assert not enc.visible(q, 0, 32, None, 0)[10].any().item()
    assert shadow.visible(q, 0, 32, None, 0)[10, :11].all().item()
    assert enc.visible(q, 0, 32, None, 0)[31].all().item()
    assert not shadow.visible(q, 0, 32, None, 0)[31].any().item()


@pytest.mark.parametrize("block", [None, 32], ids=["stacked", "per-row"])
def test_batched_decode_attention_matches_per_row(block):
    from kvcore.attention import batch_kv_attention
    from kvcore.cache import BatchCompressedKVCache

    mx.random.seed(5)
    cfg = AttentionConfig(block=block)
    rows = [CompressedKVCache(CodecSpec("affine", 4, 32), start=s, window=w, keep=2, attention=cfg) for s, w in
            ((0, None), (40, 64), (0, 48))]
    for r, n in zip(rows, (10, 50, 90)):
        r.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
    batch = BatchCompressedKVCache(rows)
    q = mx.random.normal((3, 4, 1, 16))
    view, _ = batch.update_and_fetch(mx.random.normal((3, 2, 1, 16)), mx.random.normal((3, 2, 1, 16)))
    out = batch_kv_attention(q, view, 0.25)
    for b, v in enumerate(view.rows):
        ref = _reference(q[b : b + 1], v, 0.25, None)
        assert mx.allclose(out[b : b + 1], ref, atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_quantized_matmul_decode_equals_portable_path(monkeypatch, bits, group):
    # the accelerator is chosen per call by the config: qmm on (the default) vs off
    """The CPU/Metal accelerator (attention from packed words) == the portable path."""
    from kvcore.attention import qmm
    from kvcore.cache import BatchCompressedKVCache

    mx.random.seed(11)
    cache = CompressedKVCache(CodecSpec("affine", bits, group), start=0)
    cache.update_and_fetch(mx.random.normal((1, 2, 50, 64)), mx.random.normal((1, 2, 50, 64)))
    q = mx.random.normal((1, 6, 1, 64))
    view, _ = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    sinks = mx.random.normal((6,))
    calls = []
    real = qmm.qmm_attention
    monkeypatch.setattr(qmm, "qmm_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = kv_attention(q, view, 0.125, sinks, AttentionConfig(qmm=True))
    ref = kv_attention(q, view, 0.125, sinks, AttentionConfig(qmm=False))
    if MLX_LM_QUANTIZED_FAILS:  # CUDA: quantized_matmul has no kernel here, so the accelerator never serves
        assert not calls and mx.allclose(fast, ref).item()
        assert QMM_FAILURE in mlx_lm_quantized_attention_error(bits, group)  # mlx-lm's own quantized attention
        return
    assert calls and mx.allclose(fast, ref, atol=2e-5, rtol=1e-4).item()
    assert mlx_lm_quantized_attention_error(bits, group) is None
    # packed rows of different lengths, masked per row
    rows = []
    for n in (5, 30):
        c = CompressedKVCache(CodecSpec("affine", bits, group), start=0)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(c)
    batch = BatchCompressedKVCache(rows)
    pv, _ = batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
    q2 = mx.random.normal((2, 6, 1, 64))
    fast = blockwise.packed_attention(q2, pv, 0.125, None, AttentionConfig(qmm=True))
    ref = blockwise.packed_attention(q2, pv, 0.125, None, AttentionConfig(qmm=False))
    assert mx.allclose(fast, ref, atol=2e-5, rtol=1e-4).item()


def test_cuda_kernel_is_selected_only_where_it_applies():
    """On CUDA the kernel reads channel-grouped affine codecs (any bits, mixed key/value bits); off CUDA,
    or for layouts it does not cover, the portable path runs."""
    from kvcore.attention import cuda_decode
    from kvcore.codecs import make_codec

    on_cuda = backend_name() == "cuda"
    q = mx.zeros((1, 4, 1, 64))
    k4 = make_codec(CodecSpec("affine", 4, 64), 64)
    k3 = make_codec(CodecSpec("affine", 3, 64), 64)
    for kc, vc in ((k4, k4), (k3, k3), (k4, k3)):
        assert cuda_decode.applies(q, kc, vc) is on_cuda
    # what it never takes, whatever the backend: token-grouped affine (head dim 8), more than 8 queries
    tok = make_codec(CodecSpec("affine", 4, 32), 8)
    assert not cuda_decode.applies(q, tok, tok) and not cuda_decode.applies(q, k4, tok)
    assert not cuda_decode.applies(mx.zeros((1, 4, 9, 64)), k4, k4)


def test_the_products_run_in_float32_on_cpu_and_read_fp16_scales_as_stored_elsewhere():
    """CPU: half-precision queries multiply in float32 (MLX's CPU quantized_matmul emulates half types,
    6-24x slower); Metal: bf16 queries over fp16 scales run in fp16, fp16 and f32 queries in their own."""
    from kvcore.attention.qmm import compute_dtype

    f16, bf16, f32 = mx.float16, mx.bfloat16, mx.float32
    assert compute_dtype(bf16, f16, f16, "cpu") == f32 and compute_dtype(f16, f16, f16, "cpu") == f32
    assert compute_dtype(f32, f16, f16, "cpu") == f32
    assert compute_dtype(bf16, f16, f16, "metal") == f16 and compute_dtype(f16, f16, f16, "metal") == f16
    assert compute_dtype(bf16, bf16, bf16, "metal") == bf16 and compute_dtype(f32, f16, f16, "metal") == f32


def test_quantized_matmul_decode_of_bf16_queries_reads_the_scales_as_stored(monkeypatch):
    """bf16 queries over fp16 scales: off the CPU both products run in fp16 (no per-step cast of the
    cache's context-long scale arrays); everywhere at least as close to a float32 reference as the bf16
    products were."""
    from kvcore.attention import qmm

    if MLX_LM_QUANTIZED_FAILS:
        pytest.skip("quantized_matmul has no kernel for these shapes on this backend")
    mx.random.seed(5)
    T = 300
    cache = CompressedKVCache(CodecSpec("affine", 4, 64), start=0)
    k, v = mx.random.normal((1, 2, T, 64)).astype(mx.bfloat16), mx.random.normal((1, 2, T, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(k, v)
    view, _ = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    q = (3 * mx.random.normal((1, 6, 1, 64))).astype(mx.bfloat16)
    wide = []
    real_astype = mx.array.astype
    monkeypatch.setattr(mx.array, "astype", lambda a, *x, **kw: (wide.append(a.shape) if a.dtype == mx.float16 and a.ndim > 1 and a.shape[-2] >= T else None)
                        or real_astype(a, *x, **kw))
    (wk, sk, bk), (wv, sv, bv) = view.segments[0].parts()
    fast = qmm.qmm_attention(q, (wk, sk, bk), (wv, sv, bv), cache.key_codec, cache.value_codec, 0.125)
    monkeypatch.undo()
    assert fast.dtype == mx.bfloat16 and (not wide or backend_name() == "cpu"), wide  # no fp16 scale array was cast
    ref = kv_attention(q.astype(mx.float32), view, 0.125, None, AttentionConfig(qmm=False))
    old = mx.quantized_matmul  # the bf16 products as before, for the bound
    s = old((q * 0.125).reshape(1, 2, 3, 1, 64), wk[:, :, None], sk[:, :, None].astype(mx.bfloat16),
            bk[:, :, None].astype(mx.bfloat16), transpose=True, group_size=64, bits=4).astype(mx.float32)
    p = mx.softmax(s, axis=-1).astype(mx.bfloat16)
    before = old(p, wv[:, :, None], sv[:, :, None].astype(mx.bfloat16), bv[:, :, None].astype(mx.bfloat16),
                 transpose=False, group_size=64, bits=4).reshape(1, 6, 1, 64)

    def err(x):
        return (mx.abs(x.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()

    assert err(fast) <= max(err(before), 2e-3), (err(fast), err(before))


def test_a_steady_layer_keeps_its_packed_word_decode():
    """After its first qmm decode a plain compressed layer hands its next views the kept call
    (hook._sdpa tries it first): the same output as the portable path, counted as qmm; a
    two-query verify step falls back to the general dispatch and its mask."""
    from kvcore.attention import blockwise as bw
    from kvcore.attention.hook import _sdpa

    if MLX_LM_QUANTIZED_FAILS:
        pytest.skip("quantized_matmul has no kernel for these shapes on this backend")
    mx.random.seed(9)
    cache = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    cache.update_and_fetch(mx.random.normal((1, 2, 80, 64)), mx.random.normal((1, 2, 80, 64)))
    for step, n in enumerate((1, 1, 1, 2)):
        view, _ = cache.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        assert view.launch is (bw.kept_qmm if step else None)
        q = mx.random.normal((1, 4, n, 64))
        got = _sdpa(q, view, view, cache, 0.125, None)
        ref = kv_attention(q, view, 0.125, None, AttentionConfig(qmm=False))
        assert mx.allclose(got, ref, atol=2e-5, rtol=1e-4).item(), step
    assert cache.stats.calls.get("qmm") == 4  # the verify step through the general path's qmm branch
    # a call under a config other than the cache's own keeps nothing for the cache's later steps
    other = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, attention=AttentionConfig(qmm=False))
    other.update_and_fetch(mx.random.normal((1, 2, 80, 64)), mx.random.normal((1, 2, 80, 64)))
    view, _ = other.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    kv_attention(mx.random.normal((1, 4, 1, 64)), view, 0.125, None, AttentionConfig(qmm=True))
    assert "launch" not in other.memo


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n_queries,sinks", [(1, False), (1, True), (3, False)])
def test_a_recent_dense_tail_is_read_from_packed_words_too(dtype, n_queries, sinks):
    """affine:4/r16: the view holds an encoded past (read from its words), the recent tokens' shadow and
    the dense tail; one softmax over all three equals the portable path (decode everything, then attend)."""
    from kvcore.attention import qmm

    if MLX_LM_QUANTIZED_FAILS:
        pytest.skip("quantized_matmul has no kernel for these shapes on this backend")
    mx.random.seed(7)
    T = 300
    cache = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, recent=16)
    k, v = mx.random.normal((1, 2, T, 64)).astype(dtype), mx.random.normal((1, 2, T, 64)).astype(dtype)
    cache.update_and_fetch(k, v)
    view, _ = cache.update_and_fetch(k[:, :, :n_queries], v[:, :, :n_queries])
    assert [s.kind for s in view.segments] == ["encoded", "shadow", "dense"] and qmm.segments_apply(
        mx.zeros((1, 6, n_queries, 64), dtype), view)
    q = mx.random.normal((1, 6, n_queries, 64)).astype(dtype)
    sk = mx.random.normal((6,)).astype(dtype) if sinks else None  # the model's dtype, as its attention holds them
    before = dict(cache.stats.calls)
    fast = kv_attention(q, view, 0.125, sk)
    assert cache.stats.calls.get("qmm", 0) == before.get("qmm", 0) + 1  # served from the words
    ref = kv_attention(q, view, 0.125, sk, AttentionConfig(qmm=False))
    tol = 2e-3 if dtype == mx.float32 else 2e-2
    err = (mx.abs(fast.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref.astype(mx.float32)).max()).item()
    assert fast.shape == ref.shape and err <= tol, err


def test_a_windowed_view_keeps_the_general_path():
    from kvcore.attention import qmm

    cache = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, window=64, recent=16)
    k = mx.random.normal((1, 2, 200, 64))
    cache.update_and_fetch(k, k)
    view, _ = cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert not qmm.segments_apply(mx.zeros((1, 4, 1, 64)), view)
