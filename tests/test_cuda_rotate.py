"""TurboQuant's rotations inside the decode launch (kvcore/attention/cuda_rotate.py, MLXKV_CUDA_TURBO_ROTATE=1, opt-in).
On CPU: the kernel's butterflies, as written, are mx.hadamard_transform; the signs ride after the key book; the texts of
the turbo bodies carry the rotating branch and nothing else does; which plans may rotate. On CUDA: the admission check
of rotating plans (against R^T attention(R q, ...)), and a turbo cache's steady decode with the rotations in the launch
gives the launches-around-the-kernel outputs within fp16 rounding."""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention import cuda_kernels, cuda_rotate
from kvcore.attention.cuda_check import check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name
from kvcore.codecs import CodecSpec
from kvcore.codecs.rotation import make_rotation
from kvcore.codecs.turbo import TurboCodec


def _run_butterflies(buf: np.ndarray, vectors: int, dim: int) -> np.ndarray:
    """The kernel's butterfly loops (cuda_rotate._butterflies), index formula for index formula."""
    text = cuda_rotate._butterflies("buf", "V", "N")
    lo_expr = re.search(r"lo = (.+);\n", text).group(1)
    assert lo_expr == "(i / (N / 2)) * N + (j / len) * 2 * len + j % len"
    buf = buf.copy().reshape(-1)
    length = 1
    while length < dim:
        for i in range(vectors * (dim // 2)):
            j = i % (dim // 2)
            lo = (i // (dim // 2)) * dim + (j // length) * 2 * length + j % length
            x, y = buf[lo], buf[lo + length]
            buf[lo], buf[lo + length] = x + y, x - y
        length *= 2
    return buf.reshape(vectors, dim)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_the_butterflies_are_the_hadamard_transform(dim):
    x = np.random.default_rng(dim).standard_normal((3, dim)).astype(np.float32)
    got = _run_butterflies(x, 3, dim) / np.sqrt(dim)
    assert np.abs(got - np.array(mx.hadamard_transform(mx.array(x)))).max() < 1e-5
    rot = make_rotation(dim, 0)  # the codec's R x = H (s x) / sqrt(d) and its inverse, as the kernel applies them
    s = np.array(rot.signs)
    fwd = _run_butterflies(x * s, 3, dim) / np.sqrt(dim)
    assert np.abs(fwd - np.array(rot.forward(mx.array(x)))).max() < 1e-5
    back = _run_butterflies(fwd, 3, dim) / np.sqrt(dim) * s
    assert np.abs(back - x).max() < 1e-5


def test_the_signs_ride_after_the_key_book():
    codec = TurboCodec(CodecSpec("turbo", 4), 128)
    both = cuda_rotate.book_with_signs(codec.centroids, codec.rotation.signs)
    assert both.shape == (16 + 128,) and both.dtype == mx.float32
    assert mx.array_equal(both[:16], codec.centroids.astype(mx.float32)).item()
    assert mx.array_equal(both[16:], codec.rotation.signs).item()
    assert cuda_rotate.book_with_signs(codec.centroids, codec.rotation.signs) is both  # made once


def test_only_turbo_bodies_carry_the_rotating_branch():
    turbo = cuda_kernels.body(1, "turbo", 128, 128)
    assert "if constexpr (ROT)" in turbo and "rsqrtf(static_cast<float>(D))" in turbo
    assert turbo.count("__syncthreads();") > cuda_kernels.body(1).count("__syncthreads();")
    assert "ROT" not in cuda_kernels.body(3, "form3", 1) and "ROT" not in cuda_kernels.body(1)
    t4, t3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    plan = Plan(t4, t3, 4, 1, False, 1)
    assert ("ROT", 0) in plan.template and ("ROT", 1) in replace(plan, rotate=True).template
    a4 = Side("affine", 4, 64, 128)
    assert all(name != "ROT" for name, _ in Plan(a4, a4, 4, 1, False, 3).template)


def test_which_plans_may_rotate():
    t4, t3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    rotating = Plan(t4, t3, 4, 1, False, 1, rotate=True)
    assert rotating.why_not() is None and rotating != Plan(t4, t3, 4, 1, False, 1)
    assert rotating.merges_in_launch(64) and not Plan(t4, t3, 4, 1, False, 1).merges_in_launch(10**6)
    most = (rotating.smem - rotating.layout["KT"]) // (4 * rotating.qvb) - 1  # splits whose weights fill the memory
    assert Plan(t4, t3, 4, 1, False, 1).merges_in_launch(most) and not rotating.merges_in_launch(most)  # + outputs
    a4 = Side("affine", 4, 64, 128)
    assert "rotates turbo rows" in Plan(a4, a4, 4, 1, False, 3, rotate=True).why_not()
    assert "rotates turbo rows" in Plan(t4, t3, 4, 1, False, 0, rotate=True).why_not()  # the scalar body: no


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, vb, dim, rep, n, form", [(4, 3, 128, 4, 1, 1), (4, 3, 128, 4, 1, 3), (4, 4, 64, 8, 1, 1),
                                                       (8, 8, 256, 2, 1, 1), (4, 3, 128, 4, 2, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rotating_plans_pass_the_admission_check(monkeypatch, kb, vb, dim, rep, n, form, dtype):
    monkeypatch.setenv("MLXKV_CUDA_TURBO_FORM", str(form))
    plan = Plan(Side("turbo", kb, dim, dim), Side("turbo", vb, dim, dim), rep, n, False, form, rotate=True)
    assert plan.why_not() is None
    for seed in (0, 1):
        assert check_plan(plan, getattr(mx, dtype), seed=seed) is None


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
def test_a_turbo_cache_decodes_the_same_with_the_rotations_in_the_launch(monkeypatch):
    from kvcore.attention.config import AttentionConfig
    from kvcore.bench.grid import scheme_policy
    from kvcore.cache import CompressedKVCache
    from mlx_lm.models.base import scaled_dot_product_attention as sdpa

    pol = scheme_policy("turbo:k4v3")
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("MLXKV_CUDA_TURBO_ROTATE", on)
        mx.random.seed(5)
        c = CompressedKVCache(pol.codec, pol.value_codec, start=0,
                              attention=AttentionConfig(cuda_kernel=True, cuda_min_tokens=0))
        k = mx.random.normal((1, 8, 3000, 128)).astype(mx.bfloat16)
        c.update_and_fetch(k, k * 0.5)
        steps = []
        for _ in range(4):  # steady steps: the kept launch
            k1 = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
            keys, values = c.update_and_fetch(k1, k1)
            q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
            steps.append(sdpa(q, keys, values, cache=c, scale=128 ** -0.5, mask=None))
        mx.eval(steps)
        outs[on] = steps
    for a, b in zip(outs["0"], outs["1"]):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 1e-2
