"""Property: whatever is done to a valid cache file, loading it fails only with MlxkvError.

Opening, restoring the caches of a file that opens, and inspecting are all covered; three
base files: a compressed sliding window (encoded blocks), mlx-lm caches with SSM state
(qwen3_5), and an mlx-lm prompt-cache file.
"""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from fixtures import cache_mutations as m
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions
from kvcore.store import inspect_cache, open_cache_file
from store_helpers import job

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_models):
    d = tmp_path_factory.mktemp("fuzz")
    opts = KVOptions(max_kv_size=40, keep=2, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    job("Once upon a time there was a little girl who liked to play in the park", None, 24, opts,
        save_cache=str(d / "window.kv"))
    job("Once upon a time", str(tiny_models("qwen3_5")), 2, save_cache=str(d / "ssm.kv"))
    model, tok = load(str(tiny_models("llama")))
    cache = make_prompt_cache(model)
    model(mx.array(tok.encode("Once upon a time"))[None], cache=cache)
    save_prompt_cache(str(d / "mlx_lm.safetensors"), cache, {"k": "v"})
    files = [d / "window.kv", d / "ssm.kv", d / "mlx_lm.safetensors"]
    return Bases(d / "mutant.kv", [f.read_bytes() for f in files])


class Bases(tuple):
    """(mutant path, base file bytes); a short repr keeps hypothesis' failure reports readable."""

    def __new__(cls, path, files):
        return super().__new__(cls, (path, files))

    def __repr__(self):
        return "Bases(...)"


def check_loader(path) -> str:
    """Open, restore and inspect; returns "ok" or "error", raises anything else."""
    try:
        cf = open_cache_file(path)
        mx.eval([c.state for c in cf.restore() if hasattr(c, "offset")])
        result = "ok"
    except MlxkvError as e:
        assert "\n" not in str(e)
        result = "error"
    try:
        inspect_cache(path)
    except MlxkvError:
        pass
    return result


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
edge_ints = st.sampled_from([-1, 0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 128, 2**31, 2**63])


@settings(max_examples=600, **SETTINGS)
@given(base=st.integers(0, 2), ops=st.lists(st.tuples(st.sampled_from(["flip", "flip_head", "cut", "insert", "len"]),
                                                       st.integers(0, 2**40), st.integers(0, 255),
                                                       st.binary(max_size=16)), min_size=1, max_size=4))
def test_byte_mutations_only_raise_mlxkv_errors(bases, base, ops):
    path, files = bases
    data = files[base]
    n_header = 8 + int.from_bytes(data[:8], "little")
    for op, pos, mask, blob in ops:
        if len(data) == 0:
            break
        if op == "flip":
            data = m.flip(data, pos, mask)
        elif op == "flip_head":
            data = m.flip(data, pos % n_header, mask)
        elif op == "cut":
            data = m.truncate(data, pos)
        elif op == "insert":
            data = m.insert(data, pos, blob)
        else:
            data = m.set_length(data, pos if mask % 2 else n_header - 8 + mask - 128)
    path.write_bytes(data)
    check_loader(path)


@settings(max_examples=500, **SETTINGS)
@given(base=st.integers(0, 2), where=st.sampled_from(["doc", "header"]), index=st.integers(0, 10**6),
       value=json_values | edge_ints, delete=st.booleans())
def test_structural_edits_only_raise_mlxkv_errors(bases, base, where, index, value, delete):
    path, files = bases
    edit = m.edit_doc if where == "doc" else m.edit_header
    path.write_bytes(edit(files[base], index, value, delete))
    check_loader(path)


def test_bases_load(bases):
    path, files = bases
    for data, expected in zip(files, ("ok", "ok", "error")):  # mlx-lm files are inspected, not loaded
        path.write_bytes(data)
        assert check_loader(path) == expected
