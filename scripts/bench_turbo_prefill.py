#!/usr/bin/env python3
"""Turbo prefill's per-chunk cost against affine's, piece by piece (issue 14), one layer's shapes.

One attention layer of a chunked prefill, timed apart (each piece evaluated on its own, the median
of --repeats after one warm-up): the chunk's encode (K and V), the cache's `update_and_fetch` of a
chunk over a past of --past tokens plus the layer's attention (the hook's call: `in_rotated_basis`
around `kv_attention`), the decode of the whole layer into the scratch, the query/output rotations,
and the fused SDPA alone over dense K/V. Graph nodes per piece from `mx.export_to_dot`. Random data.

    python scripts/bench_turbo_prefill.py [--past 8192] [--chunk 2048] [--kv-heads 8] [--q-heads 32]
        [--head-dim 128] [--dtype bfloat16] [--schemes affine:4,turbo:k4v3] [--repeats 5] [--layer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx

from kvcore.attention.blockwise import kv_attention
from kvcore.attention.rotated import in_rotated_basis, shared_rotation
from kvcore.attention.scratch import decoded
from kvcore.bench.grid import scheme_policy
from kvcore.cache.compressed import CompressedKVCache


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() evaluated, after one warm-up."""
    mx.eval(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 2)


def nodes(*arrays) -> int:
    """Primitives of the graph that computes `arrays` (the labelled nodes of its DOT export)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return len(re.findall(r'label ="\w+"', f.read()))


def cache_with_past(scheme: str, past: int, shape: tuple, dtype) -> CompressedKVCache:
    pol = scheme_policy(scheme)
    c = CompressedKVCache(pol.codec, pol.value_codec, start=0)
    B, H, _, D = shape
    for lo in range(0, past, 2048):
        n = min(2048, past - lo)
        k = mx.random.normal((B, H, n, D)).astype(dtype)
        c.update_and_fetch(k, mx.random.normal((B, H, n, D)).astype(dtype))
        mx.eval(c.state)
    return c


def measure(scheme: str, a) -> dict:
    dtype = getattr(mx, a.dtype)
    kv_shape = (1, a.kv_heads, a.chunk, a.head_dim)
    k = mx.random.normal(kv_shape).astype(dtype)
    v = mx.random.normal(kv_shape).astype(dtype)
    q = mx.random.normal((1, a.q_heads, a.chunk, a.head_dim)).astype(dtype)
    mx.eval(k, v, q)
    scale = a.head_dim**-0.5
    cache = cache_with_past(scheme, a.past, kv_shape, dtype)
    kc, vc = cache.key_codec, cache.value_codec

    def encode():
        return [*kc.encode(k), *vc.encode(v)]

    def layer():  # update_and_fetch of the chunk + its attention, then the chunk is rolled back
        view, _ = cache.update_and_fetch(k, v)
        out = in_rotated_basis(kv_attention, q, view, scale, None)
        return out

    def layer_timed():
        out = layer()
        mx.eval(out)
        cache.trim(a.chunk)
        return out

    view, _ = cache.update_and_fetch(k, v)
    mx.eval(cache.state)
    rot = shared_rotation(view)
    from kvcore.attention.rotated import rotate_view

    rview = rotate_view(view, rot) if rot is not None else view
    kd, vd = decoded(rview, dtype)
    mx.eval(kd, vd)

    def decode():
        return list(decoded(rview, dtype))

    def sdpa():
        return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask="causal")

    def rotations():
        if rot is None:
            return [q]
        return [rot.forward(q).astype(dtype), rot.inverse(q, dtype)]

    row = {"scheme": scheme, "past": a.past, "chunk": a.chunk,
           "encode_ms": timed(encode, a.repeats), "encode_nodes": nodes(*encode()),
           "decode_ms": timed(decode, a.repeats), "decode_nodes": nodes(*decode()),
           "rotations_ms": timed(rotations, a.repeats),
           "rotation_nodes": nodes(*rotations())}
    cache.trim(a.chunk)
    mx.eval(cache.state)
    if not a.layer:
        return row
    row["sdpa_ms"] = timed(sdpa, a.repeats)
    mx.eval(cache.state)
    mx.eval(layer_timed())
    ts = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        layer_timed()
        ts.append((time.perf_counter() - t0) * 1e3)
    row["layer_ms"] = round(statistics.median(ts), 2)
    out = layer()
    row["layer_nodes"] = nodes(out)
    mx.eval(out)
    cache.trim(a.chunk)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--past", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--schemes", default="affine:4,turbo:k4v3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layer", action="store_true", help="also the whole layer (update_and_fetch + attention) "
                    "and SDPA alone (on CPU: use --dtype float32, bfloat16 matmuls there take seconds)")
    a = ap.parse_args()
    mx.random.seed(0)
    for scheme in a.schemes.split(","):
        print(json.dumps({**measure(scheme, a), "device": str(mx.default_device()), "data": "random"}), flush=True)


if __name__ == "__main__":
    main()
