"""The `--kv` vocabulary end to end: generate, kv_config entries with key/value bits, profiles."""

import json

import pytest
from mlx_lm import load
from typer.testing import CliRunner

from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, build_caches, resolve_policy
from mlxkv_cli.main import build_app


def run(*args):
    return CliRunner().invoke(build_app(), list(map(str, args)))


def test_generate_with_turbo_keys_and_values():
    r = run("generate", "Once upon a time", "--kv", "turbo:k8v6/r4", "--json", "-n", "12")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["kv_policy"]["codec"] == "turbo:k8v6/r4" and summary["kv_policy"]["start"] == 0
    assert summary["converted"] and summary["attention_path"].startswith("mlxkv-")
    plan = summary["plan"][0]
    assert (plan["codec"], plan["bits"], plan["value"]["bits"], plan["recent"]) == ("turbo", 8, 6, 4)


@pytest.mark.parametrize("args,message", [
    (["--kv", "lz4:4"], "unknown --kv value 'lz4:4' (known: full, affine, turbo"),
    (["--kv", "turbo:4", "--kv-bits", "4"], "--kv names the whole KV scheme"),
    (["--kv", "affine:4", "--kv-group-size", "32"], "--kv names the whole KV scheme"),
    (["--kv", "config:/no/such.json"], "kv_config file not found"),
])
def test_bad_kv_flags_are_one_line(args, message):
    r = run("generate", "x", *args)
    assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_kv_config_entries_with_key_and_value_bits(tmp_path, tiny_models):
    model = load(str(tiny_models("llama")))[0]
    p = tmp_path / "kv.json"
    p.write_text(json.dumps([{"layer_idx": 0, "codec": "turbo", "key_bits": 4, "value_bits": 3},
                             {"layer_idx": 2, "bits": 8, "group_size": 32, "calibration": "ignored"}]))
    for opts in (KVOptions(kv=f"config:{p}"), KVOptions(kv_config=str(p))):
        caches, plan = build_caches(model, resolve_policy(opts))
        assert [p.label() for p in plan] == ["turbo:k4v3", "full", "affine:8/g32"]
        assert (caches[0].key_spec.bits, caches[0].value_spec.bits) == (4, 3)
    p.write_text(json.dumps([{"layer_idx": 0, "codec": "turbo", "key_bits": 4, "value_bits": 12}]))
    with pytest.raises(MlxkvError, match="entry 0 .layer 0.: turbo bits must be one of"):
        resolve_policy(KVOptions(kv_config=str(p)))


def test_profile_may_name_a_kv_value(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('[kv]\nkv = "turbo:k5v3/r16"\n')
    policy = resolve_policy(KVOptions(profile=str(p)))
    assert policy.label() == "turbo:k5v3/r16" and policy.start == 0 and policy.source == "profile"
    assert resolve_policy(KVOptions(profile=str(p), kv_bits=4)).label() == "affine:4/g64"  # short flags override
