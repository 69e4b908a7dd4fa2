"""Turbo codec: rotation, Lloyd–Max codebooks, bit packing, error bounds, bytes vs nbytes."""

import mlx.core as mx
import numpy as np
import pytest

from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec, make_codec
from kvcore.codecs.bitpack import chunk_table, lookup, pack, packed_bytes, unpack
from kvcore.codecs.lloyd_max import expected_mse, gaussian_codebook
from kvcore.codecs.rotation import make_rotation
from kvcore.errors import MlxkvError
from kvcore.fidelity.bytes import kv_bytes
from kvcore.policy.kv_spec import parse_kv


@pytest.mark.parametrize("dim,form", [(64, "hadamard"), (128, "hadamard"), (8, "hadamard"), (80, "qr"), (48, "qr")])
def test_rotation_is_orthogonal_and_inverts(dim, form):
    r = make_rotation(dim, 0)
    assert (r.signs is not None) == (form == "hadamard")
    eye = mx.eye(dim)
    m = r.forward(eye)  # rows: R e_i
    assert mx.allclose(m @ m.T, eye, atol=2e-6).item()
    x = mx.random.normal((3, 5, dim)) * 10
    back = r.inverse(r.forward(x))
    assert mx.abs(back - x).max().item() <= 2e-6 * mx.abs(x).max().item() * np.log2(dim)


def test_rotation_is_fixed_by_its_seed():
    a, b = make_rotation.__wrapped__(80, 0), make_rotation.__wrapped__(80, 0)
    assert mx.array_equal(a.matrix, b.matrix)
    assert not mx.array_equal(a.matrix, make_rotation.__wrapped__(80, 1).matrix)
    assert mx.array_equal(make_rotation.__wrapped__(64, 0).signs, make_rotation.__wrapped__(64, 0).signs)


def test_lloyd_max_matches_the_known_gaussian_quantizers():
    # Max (1960): MSE of the optimal 1..4-bit quantizers of N(0, 1)
    for bits, mse in [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)]:
        assert abs(expected_mse(bits) - mse) < 2e-3 * mse + 2e-5
    c, b = gaussian_codebook(3)
    assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1]) and np.allclose(b, (c[1:] + c[:-1]) / 2)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [8, 64, 80, 5])
def test_bitpack_round_trip(bits, n):
    x = mx.random.randint(0, 2**bits, (2, 3, n)).astype(mx.uint8)
    p = pack(x, bits)
    assert p.dtype == mx.uint8 and p.shape[-1] == packed_bytes(n, bits) >= -(-n * bits // 8)
    assert mx.array_equal(unpack(p, bits, n), x)
    if n % 8 == 0:
        assert packed_bytes(n, bits) == n * bits // 8  # dense: no padding


@pytest.mark.parametrize("dim", [64, 80, 8])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_within_the_lloyd_max_bound(dim, bits):
    """Relative squared error per vector, on data with an outlier channel, is what Lloyd–Max promises."""
    mx.random.seed(3)
    x = mx.random.normal((2, 3, 256, dim)) + mx.array([8.0] + [0.0] * (dim - 1))  # channel 0: large mean
    codec = make_codec(CodecSpec("turbo", bits), dim)
    y = codec.decode(codec.encode(x), mx.float32)
    rel = ((x - y) ** 2).sum(-1) / (x**2).sum(-1)  # (2, 3, 256)
    assert rel.mean().item() <= 1.15 * expected_mse(bits)
    assert rel.max().item() <= 4 * expected_mse(bits)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [64, 80, 12])
def test_chunk_table_lookup_equals_unpacking(bits, n):
    values = np.linspace(-1, 1, 2**bits)
    x = mx.random.randint(0, 2**bits, (2, 3, n)).astype(mx.uint8)
    got = lookup(pack(x, bits), chunk_table(values, bits), bits, n)
    assert got.shape == x.shape and mx.array_equal(got, mx.array(values.astype(np.float32))[x])


def test_fixed_input_gives_identical_encoding():
    x = mx.random.normal((1, 2, 16, 64))
    a = make_codec(CodecSpec("turbo", 3), 64).encode(x)
    b = make_codec(CodecSpec("turbo", 3), 64).encode(x)
    assert all(mx.array_equal(p, q) for p, q in zip(a, b))
    packed, scale = a
    assert packed.dtype == mx.uint8 and packed.shape == (1, 2, 16, 24) and scale.dtype == mx.float16


@pytest.mark.parametrize("kv,head_dim", [("turbo:k4v3", 64), ("turbo:k8v2", 80), ("turbo:3/r8", 64),
                                         ("affine:4/g32/r8", 64)])
def test_bytes_per_token_match_nbytes(kv, head_dim):
    s = parse_kv(kv)
    c = CompressedKVCache(s.key, s.value, start=0, recent=s.recent)
    H, T = 3, 200
    for i in range(0, T, 64):
        n = min(64, T - i)
        c.update_and_fetch(mx.random.normal((1, H, n, head_dim)), mx.random.normal((1, H, n, head_dim)))
    kc, vc = make_codec(s.key, head_dim), make_codec(s.value, head_dim)
    dense = s.recent * H * 2 * head_dim
    assert c.tail.n == s.recent and c.nbytes == (T - s.recent) * (kc.bytes_per_token(H) + vc.bytes_per_token(H)) \
        + dense * 4
    b = kv_bytes([c])
    assert b.nbytes == c.nbytes and b.deployed == c.nbytes - dense * 2 and b.elements == T * H * 2 * head_dim
    if s.key.name == "turbo":  # bits + 16 / head_dim per element, norms at 2 bytes
        assert kc.bytes_per_token(1) * 8 == s.key.bits * head_dim + 16


@pytest.mark.parametrize("text,message", [
    ("turbo:9", "turbo bits must be one of"), ("turbo:kv", "bits must be N or kNvM"), ("lz4:4", "unknown --kv value"),
    ("turbo:4/g32", "unknown option 'g32'"), ("affine:4/x", "unknown option 'x'"), ("config:", "needs a file"),
])
def test_bad_kv_values_name_the_problem(text, message):
    with pytest.raises(MlxkvError, match=message):
        parse_kv(text)


def test_kv_values_round_trip_through_their_label():
    for text in ("full", "affine:4/g64", "affine:4/g32", "turbo:k4v3", "turbo:4/r16", "affine:k8v4/g32/r4"):
        assert parse_kv(text).label() == text
    assert parse_kv("affine:4").label() == "affine:4/g64" and parse_kv("turbo:k4v4").label() == "turbo:4"


@pytest.mark.parametrize("bits", range(1, 9))
def test_cell_index_counts_the_boundaries_below(bits):
    """Both forms (boundary count up to COUNT_BITS, binary search above) are numpy's searchsorted,
    boundaries themselves and their float32 neighbours included."""
    from kvcore.codecs.turbo import cell_index

    b = gaussian_codebook(bits)[1].astype(np.float32)
    z = np.concatenate([b, np.nextafter(b, np.float32(np.inf)), np.nextafter(b, np.float32(-np.inf)),
                        np.random.default_rng(bits).normal(0, 2, 500).astype(np.float32), [-1e30, 1e30, 0.0]])
    z = z.astype(np.float32).reshape(1, 1, -1)
    got = cell_index(mx.array(z), bits)
    assert got.dtype == mx.uint8 and np.array_equal(np.array(got), np.searchsorted(b, z, side="left"))


@pytest.mark.parametrize("bits", [3, 4, 6])
@pytest.mark.parametrize("dim", [128, 80, 12])
def test_encode_is_per_token_at_any_length_and_as_uncompiled(bits, dim):
    """The compiled, shape-free encode: a run encoded whole, in pieces of other lengths, and with
    compilation off gives the same bytes and scales."""
    codec = make_codec(CodecSpec("turbo", bits), dim)
    x = (mx.random.normal((1, 2, 37, dim)) * 3).astype(mx.bfloat16)
    whole = codec.encode(x)
    pieces = [codec.encode(x[:, :, a:b]) for a, b in ((0, 1), (1, 8), (8, 37))]
    mx.disable_compile()
    try:
        plain = codec.encode(x)
    finally:
        mx.enable_compile()
    for i, part in enumerate(whole):
        assert part.shape[2] == 37
        assert mx.array_equal(part, mx.concatenate([p[i] for p in pieces], axis=2))
        assert mx.array_equal(part, plain[i])


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_writes_the_little_endian_bit_stream(bits):
    """Value i at bits [i*b, i*b + b) of the row's stream, independently of `unpack`."""
    v = np.random.default_rng(bits).integers(0, 2**bits, (3, 24))
    got = np.array(pack(mx.array(v.astype(np.uint8)), bits))
    for row, out in zip(v, got):
        stream = sum(int(x) << (i * bits) for i, x in enumerate(row))
        assert out.tolist() == list(stream.to_bytes(24 * bits // 8, "little"))
