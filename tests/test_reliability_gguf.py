"""Invalid GGUFs are refused, by name, before anything runs or is written: convert-model never exits
0 with a folder that cannot run, and loading never runs with misread tensors or a dropped token."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf_helpers import stories_metadata, stories_tensors
from typer.testing import CliRunner

from kvcore.errors import MlxkvError
from kvcore.gguf import load_gguf
from kvcore.gguf import writer as gw
from mlxkv_cli.main import build_app


@pytest.fixture(scope="module")
def parts():
    return stories_metadata(), stories_tensors()


def write(path: Path, meta: dict, tensors: dict, alignment: int = 32) -> Path:
    return gw.write_gguf(path, meta, tensors, alignment=alignment)


def refused(path: Path, tmp_path: Path, message: str) -> None:
    """load_gguf raises one line with `message`; convert-model exits 1 with it and writes nothing."""
    with pytest.raises(MlxkvError) as e:
        load_gguf(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    out = tmp_path / "out"
    r = CliRunner().invoke(build_app(), ["convert-model", str(path), str(out)])
    assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def _offset_at(data: bytes, name: str) -> int:
    """File position of tensor `name`'s data offset in the header (kvcore.gguf.writer's layout)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key) + len(key)
    (ndim,) = struct.unpack_from("<I", data, i)
    return i + 4 + 8 * ndim + 4


def _patch_offset(path: Path, name: str, change) -> Path:
    data = bytearray(path.read_bytes())
    at = _offset_at(bytes(data), name)
    (off,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, change(off))
    path.write_bytes(bytes(data))
    return path


# -- the container ---------------------------------------------------------------------------------
@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_not_a_power_of_two(parts, tmp_path, alignment):
    meta, tensors = parts
    path = write(tmp_path / "a.gguf", {**meta, "general.alignment": alignment}, tensors, alignment=32)
    refused(path, tmp_path, f"general.alignment {alignment} is not a power of two")


@pytest.mark.parametrize("bit,message", [(1, "is not a multiple of the alignment 32"),
                                         (5, "overlap in the file"),
                                         (40, "extends past the end")])
def test_one_bit_flip_in_a_tensor_offset(parts, tmp_path, bit, message):
    meta, tensors = parts
    path = write(tmp_path / "f.gguf", meta, tensors)
    _patch_offset(path, "blk.2.attn_k.weight", lambda off: off ^ (1 << bit))
    refused(path, tmp_path, message)


def test_a_tensor_named_twice(parts, tmp_path):
    meta, tensors = parts
    path = write(tmp_path / "d.gguf", meta, tensors)
    data = path.read_bytes()
    path.write_bytes(data.replace(b"blk.1.attn_q.weight", b"blk.0.attn_q.weight", 1))
    refused(path, tmp_path, "tensor 'blk.0.attn_q.weight' appears twice")


def test_no_tensors(parts, tmp_path):
    refused(write(tmp_path / "z.gguf", parts[0], {}), tmp_path, "GGUF holds no tensors")


def test_a_tensor_count_the_file_cannot_hold(parts, tmp_path):
    meta, tensors = parts
    path = write(tmp_path / "n.gguf", meta, tensors)
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8, 2**60)  # n_tensors
    path.write_bytes(bytes(data))
    refused(path, tmp_path, f"claims {2**60} tensors")


# -- tensors against the metadata -------------------------------------------------------------------
def _drop(name):
    return lambda meta, t: t.pop(name)


def _reshape(name, shape):
    return lambda meta, t: t.__setitem__(name, np.zeros(shape, np.float32))


def _meta(key, value):
    return lambda meta, t: meta.__setitem__(key, value)


def _short_vocab(meta, t):
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        meta[key] = meta[key][:500]


@pytest.mark.parametrize("change,message", [
    (_drop("blk.1.attn_k.weight"), "missing tensor 'blk.1.attn_k.weight'"),
    (_drop("output_norm.weight"), "missing tensor 'output_norm.weight'"),
    (_reshape("blk.3.attn_v.weight", (64, 32)), "'blk.3.attn_v.weight' has shape [64, 32], the metadata implies [32, 64]"),
    (_reshape("token_embd.weight", (512, 32)), "'token_embd.weight' has shape [512, 32]"),
    (_meta("llama.block_count", 4), "lies beyond block_count 4"),
    (_meta("llama.block_count", 6), "missing tensor 'blk.5.attn_norm.weight'"),
    (_meta("llama.attention.head_count", 0), "'llama.attention.head_count' must be a positive integer, got 0"),
    (_meta("llama.attention.head_count_kv", 0), "'llama.attention.head_count_kv' must be a positive integer"),
    (_meta("llama.attention.head_count_kv", 3), "8 attention heads are not a multiple of 3 KV heads"),
    (_meta("llama.embedding_length", 0), "'llama.embedding_length' must be a positive integer"),
    (_short_vocab, "vocabulary has 500 tokens, the embedding 512 rows"),
    (_meta("tokenizer.ggml.scores", [0.0] * 10), "'tokenizer.ggml.scores' has 10 entries for 512 tokens"),
    (_meta("tokenizer.ggml.bos_token_id", 600), "'tokenizer.ggml.bos_token_id' is 600, outside the vocabulary"),
    (_meta("tokenizer.ggml.eos_token_id", 512), "'tokenizer.ggml.eos_token_id' is 512, outside the vocabulary"),
    (_meta("tokenizer.ggml.model", "gpt2"), "byte-level BPE) vocabulary has no tokenizer.ggml.merges"),
], ids=["missing block tensor", "missing top tensor", "wrong shape", "wrong embedding", "block count low",
        "block count high", "0 heads", "0 kv heads", "heads/kv", "0 hidden", "short vocabulary", "scores",
        "bos", "eos", "gpt2 no merges"])
def test_invalid_model_gguf(parts, tmp_path, change, message):
    meta, tensors = dict(parts[0]), dict(parts[1])
    change(meta, tensors)
    refused(write(tmp_path / "m.gguf", meta, tensors), tmp_path, message)


def test_gpt2_merge_outside_the_vocabulary(parts, tmp_path):
    meta = {**parts[0], "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["▁t he", "qq zz"]}  # the first is fine
    refused(write(tmp_path / "g.gguf", meta, parts[1]), tmp_path, "merges entry 1 ('qq zz') does not join two tokens")


# -- the output folder -------------------------------------------------------------------------------
def test_convert_model_output_checked_first(dense_gguf, tmp_path):
    plain = tmp_path / "file.txt"
    plain.write_text("x")
    r = CliRunner().invoke(build_app(), ["convert-model", str(dense_gguf), str(plain / "out")])
    assert r.exit_code == 1 and f"{plain} is not a folder" in r.stderr, r.output
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            tempfile.TemporaryFile(dir=ro).close()
            ro = Path("/sys")  # permission bits do not bind root; /sys refuses new files
            tempfile.TemporaryFile(dir=ro).close()
            pytest.skip("no folder here refuses writes to this user")
        except OSError:
            pass
        r = CliRunner().invoke(build_app(), ["convert-model", str(dense_gguf), str(ro / "a" / "out")])
        assert r.exit_code == 1 and "is not writable" in r.stderr and "internal error" not in r.stderr, r.output
    finally:
        (tmp_path / "ro").chmod(0o755)
    r = CliRunner().invoke(build_app(), ["convert-model", str(dense_gguf), str(tmp_path / "new" / "deep" / "out")])
    assert r.exit_code == 0, r.output  # missing folders on the way are created


def test_a_fifo_named_as_a_gguf(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    r = CliRunner().invoke(build_app(), ["convert-model", str(fifo), str(tmp_path / "out")])
    assert r.exit_code == 1 and "is not a regular file" in r.stderr, r.output
    r = CliRunner().invoke(build_app(), ["generate", "-m", str(fifo), "-p", "x", "-n", "2"])
    assert r.exit_code == 1 and "neither a folder nor a regular .gguf file" in r.stderr, r.output
