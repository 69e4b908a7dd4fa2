"""The prefix cache's disk tier (`--prefix-cache-dir`): prompts RAM evicts are written as mlxkv
cache files and read back on a longer match than RAM has; the folder is bounded, shared safely
by servers of other models or KV policies, and a damaged file is a miss. End to end: a second
server process over the folder reuses the first one's prompt (usage says how many tokens) and
returns the same tokens as the whole prompt prefilled alone (4-bit KV from token 0: the files
hold compressed caches)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from mlx_lm import load

from serve_helpers import get, metric, post, served_port
from kvcore.engine import Engine, GenerateConfig, Request, generate_one
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.serve.prefix import PrefixCache
from kvcore.serve.server import EXTRA_MODULES
from kvcore.serve.spill import PrefixDisk, serve_fingerprint
from kvcore.store import model_fingerprint

CHUNK = 8
KV = KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
FIRST = tuple(10 + (7 * j) % 90 for j in range(24))
LATER = FIRST + (5, 6, 7, 8, 9)  # starts with FIRST
OTHER = tuple(200 + j for j in range(24))  # shares nothing with FIRST


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    path = tiny_models("qwen3")
    return (path, *load(str(path)))


def engine_with(qwen3, folder, ram: int, kv: KVOptions = KV, disk_bytes: int = 2**30) -> Engine:
    _, model, tok = qwen3
    engine = Engine(model, tok, resolve_policy(kv), 2, GenerateConfig(prefill_chunk=CHUNK))
    fp = serve_fingerprint(model_fingerprint(model, tok, {"model_type": "qwen3"}), None, engine.runner.new_caches())
    engine.prefix = PrefixCache(ram, engine.runner.new_caches, PrefixDisk(folder, disk_bytes, fp))
    return engine


def alone(qwen3, ids, n, kv: KVOptions = KV) -> list[int]:
    _, model, tok = qwen3
    caches = build_caches(model, resolve_policy(kv))[0]
    return generate_one(model, tok, Request(tuple(ids), n), caches, GenerateConfig(prefill_chunk=CHUNK)).token_ids


@pytest.mark.parametrize("kv", [KV, KVOptions()], ids=["affine4", "full"])  # full: mlx-lm's own KVCache
def test_an_evicted_prompt_comes_back_from_disk(qwen3, tmp_path, kv):
    engine = engine_with(qwen3, tmp_path, ram=2**30, kv=kv)
    engine.run([Request(FIRST, 2, "a")])
    size = engine.prefix.nbytes
    engine.prefix.capacity = int(1.5 * size)  # one prompt fits in RAM
    engine.run([Request(OTHER, 2, "b")])  # evicts FIRST, which is written to disk
    disk = engine.prefix.disk
    assert list(engine.prefix.entries) == [(None, OTHER)] and disk.writes == 1 and list(disk.index) == [(None, FIRST)]
    out = engine.run([Request(LATER, 10, "c")])[0]
    assert engine.prefix.disk_hits == 1 and engine.prefix.reused == {"c": len(FIRST)}
    assert out.token_ids == alone(qwen3, LATER, 10, kv)
    engine.prefix.flush()  # what RAM holds goes to disk too (OTHER, LATER; FIRST is there already)
    assert disk.writes == 3 and set(disk.index) == {(None, FIRST), (None, OTHER), (None, LATER)}


def test_the_folder_is_bounded_shared_and_damage_is_a_miss(qwen3, tmp_path):
    one = engine_with(qwen3, tmp_path, ram=0)  # no RAM: every prompt is written through
    one.run([Request(FIRST, 2, "a")])
    (path, size), = one.prefix.disk.index.values()
    bounded = engine_with(qwen3, tmp_path, ram=0, disk_bytes=int(1.5 * size))
    bounded.run([Request(OTHER, 2, "b")])
    assert not path.exists() and list(bounded.prefix.disk.index) == [(None, OTHER)]  # the oldest file went
    assert bounded.prefix.disk.evictions == 1
    eight = engine_with(qwen3, tmp_path, ram=0, kv=KVOptions(kv_bits=8, kv_group_size=64, quantized_kv_start=0))
    assert eight.prefix.disk.best(None, list(LATER)) == ((), 0)  # another KV policy never reads these files
    eight.run([Request(FIRST, 2, "e")])
    assert len(list(tmp_path.glob("*.kv"))) == 2  # its own file beside the 4-bit one
    (other_path, _), = bounded.prefix.disk.index.values()
    raw = bytearray(other_path.read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in the arrays: the checksum refuses the file
    other_path.write_bytes(bytes(raw))
    fresh = engine_with(qwen3, tmp_path, ram=0)
    out = fresh.run([Request(OTHER + (1, 2), 6, "d")])[0]
    assert fresh.prefix.disk.errors == 1 and fresh.prefix.hits == 0
    assert out.token_ids == alone(qwen3, OTHER + (1, 2), 6)


def test_temp_files_of_interrupted_writes_are_removed_at_start(tmp_path):
    """A crash between the temp file's write and its rename leaves `.NAME.kv.XXXX.tmp`: a server
    starting over the folder removes those older than any write takes, of any tag; a fresh one
    (another server's write in progress) and files of other names stay."""
    import os
    import time

    from kvcore.serve.spill import STALE_TEMP_S

    disk = PrefixDisk(tmp_path, 2**20, {"model": "a"})
    other = PrefixDisk(tmp_path, 2**20, {"model": "b"})
    old = time.time() - STALE_TEMP_S - 60
    stale = [tmp_path / f".{d.path_for((None, FIRST)).name}.k3j_x9.tmp" for d in (disk, other)]
    fresh = tmp_path / f".{disk.path_for((None, OTHER)).name}.p0q1r2.tmp"
    kept = [tmp_path / ".notes.tmp", tmp_path / f"{disk.path_for((None, FIRST)).name}"]
    for p in stale + [fresh] + kept:
        p.write_bytes(b"partial")
    for p in stale + kept:
        os.utime(p, (old, old))
    again = PrefixDisk(tmp_path, 2**20, {"model": "a"})
    assert again.stale_removed == 2 and not any(p.exists() for p in stale)
    assert fresh.exists() and all(p.exists() for p in kept)


def test_a_second_server_process_reuses_the_first_s_prompt(qwen3, tmp_path):
    for name in EXTRA_MODULES:
        pytest.importorskip(name)
    from kvcore.serve import ServeConfig, start_server

    path, _, tok = qwen3
    first = "Once upon a time there was a little girl named Lily. She liked to play in the park"
    later = first + " with her dog. One day"
    ids1, ids2 = tok.encode(first), tok.encode(later)
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b) if ids2[: len(ids1)] != ids1 else len(ids1)
    want = tok.decode(alone(qwen3, ids2, 10))
    a = start_server(ServeConfig(model=str(path), kv=KV, port=0, prefill_chunk=CHUNK, prefix_cache_bytes=2**26,
                                 prefix_cache_dir=str(tmp_path)))
    try:
        status, r = post(a.url, {"model": a.served.name, "prompt": first, "max_tokens": 4, "temperature": 0},
                         path="/v1/completions")
        assert status == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        a.stop()  # a clean stop writes what RAM holds to the folder
    assert len(list(tmp_path.glob("*.kv"))) == 1
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv_cli", "serve", "-m", str(path), "--port", "0",
                             "--kv-bits", "4", "--kv-group-size", "64", "--quantized-kv-start", "0",
                             "--prefill-chunk", str(CHUNK), "--prefix-cache-dir", str(tmp_path)],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{served_port(proc.stderr)}"
        status, r = post(url, {"model": "qwen3", "prompt": later, "max_tokens": 10, "temperature": 0},
                         path="/v1/completions")
        assert status == 200 and r["choices"][0]["text"] == want
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == min(shared, len(ids2) - 1) > 10
        text = get(url, "/metrics")[1]
        assert metric(text, "prefix_cache_disk_hits_total") == 1 and metric(text, "prefix_cache_disk_files") >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
