"""Bad GGUF inputs: each is refused with a one-line MlxkvError naming the problem."""

from __future__ import annotations


import numpy as np
import pytest

from gguf_helpers import stories_metadata, stories_tensors, write_dense
from kvcore.errors import MlxkvError
from kvcore.gguf import convert_gguf, load_gguf
from kvcore.gguf import writer as gw


def test_missing_file(tmp_path):
    with pytest.raises(MlxkvError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_truncated_file(dense_gguf, tmp_path):
    data = dense_gguf.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(MlxkvError, match="truncated"):
        load_gguf(half)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:1000])  # cut inside the vocabulary
    with pytest.raises(MlxkvError, match="truncated"):
        load_gguf(head)


@pytest.mark.parametrize("content", [b"", b"hello, not a model\n", bytes(range(256)) * 40])
def test_not_a_gguf(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(MlxkvError, match="not a GGUF"):
        load_gguf(bad)


def test_random_bytes_with_gguf_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    with pytest.raises(MlxkvError, match="GGUF"):
        load_gguf(bad)


@pytest.mark.parametrize("key,value,message", [
    ("general.architecture", "mamba", "unsupported GGUF architecture 'mamba'"),
    ("tokenizer.ggml.model", "bert", "tokenizer model 'bert'"),
], ids=["architecture", "tokenizer"])
def test_unsupported_metadata(tmp_path, key, value, message):
    meta = stories_metadata()
    meta[key] = value
    path = write_dense(tmp_path / f"{value}.gguf", meta)
    with pytest.raises(MlxkvError, match=message):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    tensors = dict(stories_tensors())
    raw = np.zeros(64 * 64 // 256 * 176, np.uint8).tobytes()  # Q5_K: 176 bytes / 256 weights
    tensors["blk.0.attn_q.weight"] = gw.RawTensor("Q5_K", (64, 64), raw)
    path = gw.write_gguf(tmp_path / "q5k.gguf", stories_metadata(), tensors)
    msg = r"unsupported tensor type Q5_K for tensor 'blk\.0\.attn_q\.weight'"
    with pytest.raises(MlxkvError, match=msg):
        load_gguf(path)


def test_bad_dtype(dense_gguf, tmp_path):
    with pytest.raises(MlxkvError, match="dtype"):
        convert_gguf(dense_gguf, tmp_path / "x", dtype="float8")
