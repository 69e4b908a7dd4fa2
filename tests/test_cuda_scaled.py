"""Form 3 on scaled codes (kvcore/attention/cuda_scaled.py, `MLXKV_CUDA_DEQ=scaled`): the device function's bit
placement emulated bit for bit on random words (both 16-bit halves, every bit position of every width), its one
fma against form 3's exact dequantization, and the text it builds (every piece rewritten, its own kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.attention import cuda_form3, cuda_kernels, cuda_scaled
from kvcore.attention.cuda_launch import Plan, Side


def placed_x(w: np.ndarray, bits: int, p: int) -> np.ndarray:
    """`deqs`'s x for both halves of each uint32 word: (..., 2) float16, the low half first."""
    sh = 10 - bits - p
    placed = (w << np.uint32(sh)) if sh >= 0 else (w >> np.uint32(-sh))
    mask = np.uint32(((((1 << bits) - 1) << (10 - bits)) * 0x10001) & 0xFFFFFFFF)
    u = (placed & mask) | np.uint32(0x3C003C00)
    return u.astype(np.uint32).view(np.uint16).reshape(*w.shape, 2).view(np.float16)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_placed_in_the_mantissa_are_one_plus_code_over_2_to_the_bits(bits):
    """Every pair position of a word, both halves: x = 1 + c / 2^B exactly, c the half's code at bit p."""
    w = np.random.default_rng(bits).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    for p in range(0, 16, bits):
        x = placed_x(w, bits, p).astype(np.float64)
        codes = np.stack([(w >> np.uint32(p)) & np.uint32((1 << bits) - 1),
                          (w >> np.uint32(16 + p)) & np.uint32((1 << bits) - 1)], axis=-1)
        assert np.array_equal(x, 1 + codes / 2**bits), (bits, p)


def _fma16(a, b, c) -> np.ndarray:
    """fp16 fma: the exact a * b + c (float64 holds it: 11-bit mantissas), rounded once to float16."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_one_fma_on_scaled_codes_is_the_dequantized_value_to_fp16_rounding(bits):
    """S (1 + c / 2^B) + Z with S = 2^B s, Z = fp16(z - S) against form 3's c s + z (one fp16 rounding): within
    2 fp16 ulps of the value's magnitude (|z| + 2^B s) and at most one ulp more than form 3's own rounding; a
    wrong placement (the code read one bit low) is whole steps off."""
    rng = np.random.default_rng(10 + bits)
    n = 1 << bits
    s = (rng.uniform(0.001, 2.0, 2000) / n).astype(np.float16)
    z = rng.uniform(-8, 8, 2000).astype(np.float16)
    c = rng.integers(0, n, 2000)
    S = (s.astype(np.float64) * n).astype(np.float16)  # exact: a power of two
    assert np.array_equal(S.astype(np.float64), s.astype(np.float64) * n)
    Z = (z.astype(np.float64) - S.astype(np.float64)).astype(np.float16)
    x = (1 + c / n).astype(np.float16)
    got = _fma16(x, S, Z).astype(np.float64)
    form3 = _fma16(c.astype(np.float16), s, z).astype(np.float64)  # deq2: c exact, then one fma
    exact = c * s.astype(np.float64) + z.astype(np.float64)
    ulp = np.spacing(np.maximum(np.abs(exact), np.abs(z.astype(np.float64)) + n * s.astype(np.float64)).astype(np.float16))
    ulp = ulp.astype(np.float64)
    assert np.all(np.abs(got - exact) <= 2 * ulp) and np.all(np.abs(form3 - exact) <= ulp)
    assert np.all(np.abs(got - exact) <= np.abs(form3 - exact) + ulp)  # at most one fp16 ulp more than form 3's
    wrong = _fma16((1 + (c // 2) / n).astype(np.float16), S, Z).astype(np.float64)
    assert np.abs(wrong - exact).max() > 0.4 * s.astype(np.float64).max()


def test_the_scaled_body_rewrites_every_product_and_is_its_own_kernel(monkeypatch):
    """MLXKV_CUDA_DEQ=scaled: form 3's text with no `deq2` left in its products (four key pairs, the value pairs),
    S and Z made per tile, the header's `deqs`; its own kernel object; other forms and unset: untouched."""
    text = cuda_scaled.body()
    assert "deq2(" not in text and text.count("deqs(") == 5 and "__hsub2(za[u], sa[u])" in text
    assert "ZA = __hsub2(zA, SA)" in text and text != cuda_form3.BODY
    A = Side("affine", 4, 64, 128)
    three, one = Plan(A, A, 4, 1, False, 3), Plan(A, A, 4, 1, False, 1)
    monkeypatch.delenv("MLXKV_CUDA_DEQ", raising=False)
    monkeypatch.setenv("MLXKV_CUDA_LEAN", "0")  # form 3's text as it is (cuda_lean.py, the default, rewrites its loop)
    assert cuda_kernels._special(three) == ("form3", 0, 0)
    monkeypatch.setenv("MLXKV_CUDA_DEQ", "scaled")
    assert cuda_kernels._special(three) == ("scaled", 0, 0) and cuda_kernels._special(one) == ("", 0, 0)
    assert cuda_kernels.body(3, "scaled") == cuda_kernels.src.compact(
        cuda_kernels.src.prologue() + text + cuda_kernels.src.tail())
    assert "deqs(uint32_t w" in cuda_kernels.header(True, 4, "scaled") and "deqs(" not in cuda_kernels.header(True)
    with pytest.raises(AssertionError, match="cuda_scaled"):
        cuda_scaled._swap("nothing here", cuda_scaled._VALUE_SWAPS)
