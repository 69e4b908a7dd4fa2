"""Prefill over a compressed past in one fused call (or query groups) == reference attention over
the dequantized KV, whatever the chunking: every codec, windows, sinks, recent tokens, GQA, rows."""

import mlx.core as mx
import pytest

from kvcore.attention import batch_kv_attention, kv_attention, reference_attention
from kvcore.attention.config import AttentionConfig
from kvcore.attention.prefill import plan_call
from kvcore.attention.rotated import in_rotated_basis
from kvcore.attention.scratch import CallShape
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import CodecSpec

A4, A3, T4, T3 = CodecSpec("affine", 4, 64), CodecSpec("affine", 3, 32), CodecSpec("turbo", 4), CodecSpec("turbo", 3)
CASES = {
    # name: (key spec, value spec, head_dim, start, window, keep, recent, sinks)
    "affine4": (A4, A4, 64, 0, None, 0, 0, False),
    "affine3-token-layout-sinks": (A3, A3, 48, 0, None, 0, 0, True),  # head_dim 48 % 32: blocks of 32 tokens
    "turbo-k4v3-recent": (T4, T3, 64, 0, None, 0, 24, False),
    "affine4-window-keep": (A4, A4, 64, 0, 300, 4, 0, True),
    "affine4-delayed-start-recent": (A4, A4, 64, 300, None, 0, 16, False),
    "full-window": (CodecSpec("full"), CodecSpec("full"), 32, 0, 250, 2, 0, False),
}
TOTAL = 640
CHUNKINGS = [(640,), (256, 256, 128), (50, 300, 1, 289)]
HQ, HKV, B = 4, 2, 2  # GQA, two batch rows


def _reference(q, view, scale, sinks):
    """Each segment materialized dense, masked by the positional rule (`Segment.visible`)."""
    ks, vs, ms = [], [], []
    for s in view.segments:
        k, v = s.dense(0, s.length, mx.float32)
        ks.append(k)
        vs.append(v)
        ms.append(s.visible(view.q_positions, 0, s.length, view.window, view.keep))
    K, V, M = (mx.concatenate(x, axis=a) for x, a in ((ks, 2), (vs, 2), (ms, 1)))
    return reference_attention(q, K, V, scale, M, sinks)


def _data(head_dim, total=TOTAL, seed=0):
    mx.random.seed(seed)
    shape = (B, HKV, total, head_dim)
    return mx.random.normal(shape), mx.random.normal(shape), mx.random.normal((B, HQ, total, head_dim))


def _split_at(chunks, start):
    """The chunks, one cut at the conversion start (as the engine's prefill cuts them)."""
    out, at = [], 0
    for n in chunks:
        if at < start < at + n:
            out += [start - at, at + n - start]
        else:
            out.append(n)
        at += n
    return out


def _run(case, chunks, cfg, rotated=False, check=True):
    """Outputs (B, Hq, total, D) of feeding the chunks; each call checked against the reference."""
    kspec, vspec, hd, start, window, keep, recent, sinks = CASES[case]
    k, v, q = _data(hd)
    sink = mx.random.normal((HQ,), key=mx.random.key(1)) if sinks else None
    cache = CompressedKVCache(kspec, vspec, start=start, window=window, keep=keep, recent=recent, attention=cfg)
    outs, at = [], 0
    for n in _split_at(chunks, start):
        if cache.pending_conversion:
            cache.convert()
        view, _ = cache.update_and_fetch(k[:, :, at : at + n], v[:, :, at : at + n])
        qc = q[:, :, at : at + n]
        attend = (lambda *a: in_rotated_basis(kv_attention, *a)) if rotated else kv_attention
        out = attend(qc, view, hd**-0.5, sink)
        if check:
            ref = _reference(qc, view, hd**-0.5, sink)
            assert mx.allclose(out, ref, atol=3e-5, rtol=1e-4).item(), (case, n, mx.abs(out - ref).max().item())
        outs.append(out)
        at += n
    return mx.concatenate(outs, axis=2), cache.stats


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_equals_reference_and_is_chunk_invariant(case):
    """One fused call per chunk (no blockwise loop), == the reference, and the same outputs
    whatever the chunking (chunks cut across blocks, windows and the conversion start)."""
    outs = []
    for i, chunks in enumerate(CHUNKINGS):
        out, stats = _run(case, chunks, AttentionConfig(), check=i == 1)
        assert "blockwise" not in stats.calls and stats.calls["fused"] >= len(chunks) - 1, stats.calls
        outs.append(out)
    for out in outs[1:]:
        assert mx.allclose(out, outs[0], atol=3e-5, rtol=1e-4).item(), (case, mx.abs(out - outs[0]).max().item())


@pytest.mark.parametrize("case", ["affine4", "affine3-token-layout-sinks", "turbo-k4v3-recent", "affine4-window-keep"])
def test_query_groups_under_a_small_budget_equal_one_call(case):
    """A budget the one-call plan exceeds splits the chunk's queries into groups (still fused,
    still == the reference), and gives the outputs of the unbounded call."""
    kspec, vspec, hd, start, window, keep, recent, sinks = CASES[case]
    k, v, _q = _data(hd)
    cache = CompressedKVCache(kspec, vspec, start=start, window=window, keep=keep, recent=recent)
    cache.update_and_fetch(k[:, :, :384], v[:, :, :384])
    view, _ = cache.update_and_fetch(k[:, :, 384:], v[:, :, 384:])
    whole = plan_call(CallShape.of((B, HQ, 256), mx.float32, view, sinks), mx.float32, 1 << 40)
    assert whole.group == 256
    limit = whole.bytes.total - whole.bytes.scores // 2  # room for half the queries' scores (groups in flight)
    grouped = plan_call(CallShape.of((B, HQ, 256), mx.float32, view, sinks), mx.float32, limit)
    assert grouped is not None and 8 <= grouped.group < 256 and grouped.bytes.total <= limit
    small = _run(case, (384, 256), AttentionConfig(scratch_bytes=limit))[0]
    big, _stats = _run(case, (384, 256), AttentionConfig(), check=False)
    assert mx.allclose(small, big, atol=3e-5, rtol=1e-4).item()


def test_turbo_in_the_rotated_basis_through_the_prefill_path():
    out, stats = _run("turbo-k4v3-recent", (256, 256, 128), AttentionConfig(), rotated=True, check=False)
    plain, _ = _run("turbo-k4v3-recent", (256, 256, 128), AttentionConfig(rotated=False), check=False)
    assert set(stats.calls) == {"fused"}
    assert mx.allclose(out, plain, atol=3e-5, rtol=1e-4).item()


def test_batch_rows_prefill_equals_each_row_alone():
    """A BatchKVView update of several tokens (rows of different lengths, windows) == each row's
    own prefill call."""
    mx.random.seed(5)
    rows = [CompressedKVCache(A4, start=s, window=w, keep=2) for s, w in ((0, None), (40, 300), (0, None))]
    for r, n in zip(rows, (300, 500, 30)):
        r.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    batch = BatchCompressedKVCache(rows)
    q = mx.random.normal((3, 4, 64, 64))
    view, _ = batch.update_and_fetch(mx.random.normal((3, 2, 64, 64)), mx.random.normal((3, 2, 64, 64)))
    out = batch_kv_attention(q, view, 0.125)
    for b, v in enumerate(view.rows):
        ref = _reference(q[b : b + 1, :, view.skips[b]:], v, 0.125, None)
        assert mx.allclose(out[b : b + 1, :, view.skips[b]:], ref, atol=3e-5, rtol=1e-4).item()


def test_the_scratch_does_not_fit_falls_back_to_the_bounded_blockwise_loop():
    out, stats = _run("affine4", (256, 256, 128), AttentionConfig(scratch_bytes=1 << 20))
    assert "blockwise" in stats.calls
    ref, _ = _run("affine4", (256, 256, 128), AttentionConfig(), check=False)
    assert mx.allclose(out, ref, atol=3e-5, rtol=1e-4).item()
