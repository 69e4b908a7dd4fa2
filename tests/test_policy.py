"""kv_config, profiles and flags resolve into the per-layer plan users asked for."""

import json

import pytest
from mlx_lm import load

from kvcore.cache import CompressedKVCache
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, build_caches, load_profile, profile_names, resolve_policy


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load(str(tiny_models("llama")))[0]


def write(tmp_path, data, name="kv_config.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_kv_config_applies_exactly_the_listed_layers(tmp_path, llama):
    cfg = write(tmp_path, [{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 2, "bits": 8}])
    policy = resolve_policy(KVOptions(kv_config=cfg))
    assert policy.start == 0  # kv_config default start
    caches, plan = build_caches(llama, policy)
    assert [(p.codec.name, p.codec.bits, p.codec.group_size) for p in plan] == [
        ("affine", 4, 32), ("full", None, None), ("affine", 8, 64)]
    assert all(isinstance(c, CompressedKVCache) for c in caches)
    assert [c.key_spec.compresses for c in caches] == [True, False, True]


BAD = [
    ({"layer_idx": 0, "bits": 4}, "expected a JSON list"),
    ([{"layer_idx": 0, "bits": 7}], "bits 7"),
    ([{"layer_idx": 0, "bits": 4, "group_size": 48}], "group_size 48"),
    ([{"layer_idx": 0, "bits": 4}, {"layer_idx": 0, "bits": 8}], "duplicates entry 0"),
    ([{"layer_idx": "0", "bits": 4}], "layer_idx must be an integer"),
    ([{"layer_idx": 1.5, "bits": 4}], "layer_idx must be an integer"),
    ([{"layer_idx": True, "bits": 4}], "layer_idx must be an integer"),
    ([{"bits": 4}], "missing 'layer_idx'"),
    ([{"layer_idx": -1, "bits": 4}], "negative"),
    ([{"layer_idx": 9, "bits": 4}], "out of range"),
    ([3], "expected an object"),
    ("[{not json", "not valid JSON"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_malformed_kv_config_names_the_problem(tmp_path, llama, data, message):
    with pytest.raises(MlxkvError, match=message):
        build_caches(llama, resolve_policy(KVOptions(kv_config=write(tmp_path, data))))


def test_kv_config_naming_an_ssm_layer_is_refused(tmp_path, tiny_models):
    model = load(str(tiny_models("qwen3_5")))[0]
    with pytest.raises(MlxkvError, match="ArraysCache layer, not attention"):
        build_caches(model, resolve_policy(KVOptions(kv_config=write(tmp_path, [{"layer_idx": 0, "bits": 4}]))))


def test_kv_config_on_a_kv_sharing_model(tmp_path, tiny_models):
    """Gemma 4: cache-owning layers come first, so layer_idx == cache position; shared layers refused."""
    model = load(str(tiny_models("gemma4")))[0]
    cfg = write(tmp_path, [{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 2, "bits": 8}])
    caches, plan = build_caches(model, resolve_policy(KVOptions(kv_config=cfg)))
    assert len(caches) == 3
    assert [(p.codec.bits, p.kind) for p in plan] == [(4, "window"), (None, "window"), (8, "full-attention")]
    with pytest.raises(MlxkvError, match="layer_idx 4 is a KV-shared layer"):
        build_caches(model, resolve_policy(KVOptions(kv_config=write(tmp_path, [{"layer_idx": 4, "bits": 4}]))))


def test_shipped_profiles_and_flag_override():
    assert {"full", "q8", "q4", "q4-delayed"} <= set(profile_names())
    p = resolve_policy(KVOptions(profile="q4"))
    assert (p.codec.bits, p.codec.group_size, p.start) == (4, 64, 0)
    p = resolve_policy(KVOptions(profile="q4", kv_bits=8, quantized_kv_start=7))
    assert (p.codec.bits, p.start) == (8, 7)
    assert resolve_policy(KVOptions(profile="q4-delayed")).start == 512
    assert not resolve_policy(KVOptions(profile="full")).compresses


def test_uniform_bits_default_start_is_mlx_lm_s():
    assert resolve_policy(KVOptions(kv_bits=4)).start == 5000


@pytest.mark.parametrize("text,message", [
    ("[kv]\nbitz = 4\n", "unknown key 'kv.bitz'"),
    ("[kv]\nbits = 'four'\n", "'kv.bits' must be int"),
    ("colour = 1\n", "unknown key 'colour'"),
    ("[kv\n", "not valid TOML"),
])
def test_malformed_profile_names_its_key(tmp_path, text, message):
    path = write(tmp_path, text, "p.toml")
    with pytest.raises(MlxkvError, match=message):
        load_profile(path)


@pytest.mark.parametrize("opts,message", [
    (KVOptions(kv_bits=7), "--kv-bits"),
    (KVOptions(kv_bits=4, kv_group_size=48), "--kv-group-size"),
    (KVOptions(kv_bits=4, quantized_kv_start=-1), "--quantized-kv-start"),
    (KVOptions(max_kv_size=3, keep=4), "--max-kv-size"),
    (KVOptions(profile="nope"), "unknown profile"),
    (KVOptions(kv_config="/no/such/file.json"), "not found"),
])
def test_bad_flags(opts, message):
    with pytest.raises(MlxkvError, match=message):
        resolve_policy(opts)
