"""K and V in one set of encoded arrays (`view.Joint`) when one affine codec serves both.

The layout must change nothing a user can see: the stored bytes, the saved arrays and every
attention path give what separate K and V arrays give, bit for bit, and a decode step writes
fewer arrays (the launch count a GPU step pays per layer).
"""

from __future__ import annotations

import io
import re
from collections import Counter

import mlx.core as mx
import pytest

from kvcore.attention.config import AttentionConfig
from kvcore.attention.hook import _sdpa
from kvcore.backend import backend_name
from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec
from kvcore.codecs.affine import AffineCodec

HQ, HKV, D = 4, 2, 64


def _tokens(seed: int, n: int, dtype=mx.float32):
    mx.random.seed(seed)
    return (mx.random.normal((1, HKV, n, D)).astype(dtype), mx.random.normal((1, HKV, n, D)).astype(dtype))


def _fill(joint: bool, monkeypatch, dtype=mx.float32, config=AttentionConfig(), **kw):
    """A cache fed a 37-token prompt, then 5 single tokens; the outputs of every update."""
    with monkeypatch.context() as m:
        m.setattr(AffineCodec, "joint", joint)
        c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, attention=config, **kw)
        outs = []
        for i, n in enumerate((37, 1, 1, 1, 1, 1)):
            k, v = _tokens(i, n, dtype)
            mx.random.seed(100 + i)
            q = mx.random.normal((1, HQ, n, D)).astype(dtype)
            view, _ = c.update_and_fetch(k, v)
            outs.append(_sdpa(q, view, view, c, D ** -0.5, "causal" if n > 1 else None))
        mx.eval(outs, c.state)
    assert c.joint is joint
    return c, outs


@pytest.mark.parametrize("kw", [{}, {"recent": 3}, {"window": 16, "keep": 2}], ids=["plain", "recent", "window"])
@pytest.mark.parametrize("qmm", [True, False], ids=["qmm", "fused"])
def test_joint_storage_equals_separate_arrays(monkeypatch, kw, qmm):
    cfg = AttentionConfig(qmm=qmm)
    a, out_a = _fill(True, monkeypatch, config=cfg, **kw)
    b, out_b = _fill(False, monkeypatch, config=cfg, **kw)
    assert a.nbytes == b.nbytes and a.layout() == b.layout()
    assert len(a.state) == len(b.state)
    for x, y in zip(a.state, b.state):  # saved arrays: K parts, then V parts, as before
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
    for x, y in zip(out_a, out_b):
        assert mx.array_equal(x, y).item()


def test_joint_state_loads_back_and_continues_the_same(monkeypatch):
    a, _ = _fill(True, monkeypatch)
    b = CompressedKVCache.from_state(a.state, a.meta_state)
    assert b.joint and b.enc.parts[0].shape[1] == 2 * HKV
    k, v = _tokens(7, 1)
    q = mx.random.normal((1, HQ, 1, D))
    va, _ = a.update_and_fetch(k, v)
    vb, _ = b.update_and_fetch(k, v)
    assert mx.array_equal(_sdpa(q, va, va, a, D ** -0.5, None), _sdpa(q, vb, vb, b, D ** -0.5, None)).item()


def test_key_and_value_codecs_that_differ_keep_separate_arrays():
    c = CompressedKVCache(CodecSpec("affine", 8, 32), CodecSpec("affine", 4, 32), start=0)
    c.update_and_fetch(*_tokens(0, 3))
    assert not c.joint and len(c.enc.parts) == 6


def _primitives(arrays) -> Counter:
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_a_decode_step_writes_each_encoded_part_once(dtype):
    """One token into a steady-state affine layer: one quantize of K and V together and one
    write per part (3), not a quantize and three writes each for K and V (and, for bfloat16,
    one widening of the input instead of four of the scales and biases)."""
    c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    c.update_and_fetch(*_tokens(0, 20, dtype))
    k, v = _tokens(1, 1, dtype)
    mx.eval(c.enc.parts, k, v)
    c.update_and_fetch(k, v)
    ops = _primitives(c.enc.parts)
    if backend_name() == "cuda":  # kvcore.attention.cuda_encode: the encode is one launch, then the writes
        assert ops == Counter({"CustomKernel": 1, "SliceUpdate": 3}), ops
        return
    assert ops["Quantize"] == 1 and ops["SliceUpdate"] == 3 and ops["Concatenate"] == 1
    assert ops["AsType"] == (1 if dtype == mx.bfloat16 else 2)
    assert sum(ops.values()) == ops["Quantize"] + ops["SliceUpdate"] + ops["Concatenate"] + ops["AsType"]


def test_a_decode_step_decodes_the_buffer_in_place(monkeypatch):
    """The portable decode reads the stored arrays whole (spare capacity included) rather than a
    slice of them, which MLX's GPU dequantize would first copy; the result is the same."""
    c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, attention=AttentionConfig(qmm=False))
    c.update_and_fetch(*_tokens(0, 20))
    view, _ = c.update_and_fetch(*_tokens(1, 1))
    seg = view.segments[0]
    seen = []
    real = AffineCodec.decode
    monkeypatch.setattr(AffineCodec, "decode", lambda self, enc, dt: seen.append(enc[0].shape) or real(self, enc, dt))
    whole = seg.dense(0, seg.length, mx.float32, spare_ok=True)
    part = seg.dense(0, seg.length, mx.float32)
    assert seen[0][2] == c.enc.capacity > c.enc.n and seen[1][2] == c.enc.n
    assert all(mx.array_equal(x, y).item() for x, y in zip(whole, part))
    assert whole[0].shape == (1, HKV, 21, D)


def test_the_cache_publishes_its_layout_and_empty_likes_of_itself():
    c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    assert c.shape_layout is None
    c.update_and_fetch(*_tokens(0, 5))
    lay = c.shape_layout
    assert (lay.batch, lay.heads, lay.head_dim, lay.value_dim, lay.key_parts, lay.joint, lay.block_tokens) == \
        (1, HKV, D, D, 3, True, 1)
    e = c.like(3)
    assert e.offset == 0 and e.nbytes == 0 and e.converted and e.shape_layout.batch == 3
    assert e.shape_layout == type(lay)(3, *[getattr(lay, f) for f in ("heads", "head_dim", "value_dim", "dtype",
                                                                   "key_parts", "joint", "block_tokens")])
