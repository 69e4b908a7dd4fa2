"""convert-kv and inspect-cache: bytes and bits, continuing after a conversion, mlx-lm files."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from helpers import mlx_lm_greedy, ours, per_family
from kvcore.engine.prompt import encode_continuation
from kvcore.policy import KVOptions, resolve_policy
from kvcore.policy.kv_spec import parse_kv
from kvcore.store import convert_cache_file, inspect_cache, open_cache_file
from store_helpers import DOC, MORE, cli, job

N = 20


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (path, model, tok))


def _continue_matches_quantizing_at_the_prefix(path, model, tok, f, opts: dict):
    prefix = open_cache_file(f).prefix_ids
    got, _ = job(MORE, path, N, load_cache=str(f))
    ref, _ = ours(model, tok, prefix + encode_continuation(tok, MORE), N,
                  KVOptions(**opts, quantized_kv_start=len(prefix)))
    assert got.completions[0].token_ids == ref and len(ref) >= 8


def test_full_to_4bit_inspect_and_continue(loaded, tmp_path):
    path, model, tok = loaded("qwen3")  # 2 KV heads, head_dim 64: channel layout at group 64
    src, dst = tmp_path / "full.kv", tmp_path / "q4.kv"
    job(DOC, path, 0, save_cache=str(src))
    n = len(open_cache_file(src).prefix_ids)
    r = cli("convert-kv", src, dst, "--kv-bits", "4", "--kv-group-size", "64")
    assert r.exit_code == 0, r.output
    per_token_full, per_token_q4 = 2 * (64 + 64) * 4, 2 * (64 + 64) * (4 + 32 / 64) / 8
    assert f"({2 * n * per_token_full} -> {int(2 * n * per_token_q4)} bytes" in r.stdout
    report = json.loads(cli("inspect-cache", dst, "--json").stdout)
    assert report["prefix_tokens"] == n and report["model"]["model_type"] == "qwen3"
    for row in report["layers"]:
        assert (row["codec"], row["bits"], row["group_size"], row["layout"]) == ("affine", 4, 64, "channel")
        assert row["tokens"] == n and row["bytes"] == n * per_token_q4 and row["bits_per_element"] == 4.5
    assert report["totals"]["kv_bytes"] == 2 * n * per_token_q4 and report["totals"]["bits_per_element"] == 4.5
    _continue_matches_quantizing_at_the_prefix(path, model, tok, dst, dict(kv_bits=4, kv_group_size=64))


@pytest.mark.parametrize("family,opts", [
    ("llama", dict(kv_bits=8, kv_group_size=32)),  # token layout: a complete block encoded, the rest dense
    ("gemma3", dict(kv_bits=4, kv_group_size=32)),  # wrapped mlx-lm windows become compressed windows
])
def test_convert_then_continue(loaded, tmp_path, family, opts):
    path, model, tok = loaded(family)
    src, dst = tmp_path / "full.kv", tmp_path / "q.kv"
    job(DOC * 2, path, 0, save_cache=str(src))
    result = convert_cache_file(src, dst, resolve_policy(KVOptions(**opts)))
    assert result.bytes_after < result.bytes_before and not result.notices
    _continue_matches_quantizing_at_the_prefix(path, model, tok, dst, opts)


@pytest.mark.parametrize("family,kv", [("qwen3", "turbo:k4v3"), ("llama", "turbo:4/r4"), ("gemma3", "turbo:k8v4/r3")])
def test_convert_to_turbo_inspect_and_continue(loaded, tmp_path, family, kv):
    path, model, tok = loaded(family)
    src, dst = tmp_path / "full.kv", tmp_path / "t.kv"
    job(DOC * 2, path, 0, save_cache=str(src))
    r = cli("convert-kv", src, dst, "--kv", kv)
    assert r.exit_code == 0, r.output
    report = json.loads(cli("inspect-cache", dst, "--json").stdout)
    attn = [row for row in report["layers"] if row["codec"] != "full"]
    assert attn and all(row["codec"] == "turbo" and row["bits"] == parse_kv(kv).key.bits for row in attn)
    if kv == "turbo:k4v3":  # 2 KV heads, head_dim 64: (4 + 3) bits per element pair + 2-byte norms
        n = report["prefix_tokens"]
        assert all(row["value_codec"] == "turbo:3" and row["bytes"] == n * 2 * (34 + 26) for row in attn)
        assert report["totals"]["bits_per_element"] == 3.75
    _continue_matches_quantizing_at_the_prefix(path, model, tok, dst, dict(kv=kv))


def test_kv_config_conversion_and_going_back_up(loaded, tmp_path):
    path, model, tok = loaded("llama")
    kvc = tmp_path / "kv.json"
    kvc.write_text(json.dumps([{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 2, "bits": 2, "group_size": 32}]))
    src, mixed, up, full = (tmp_path / f"{x}.kv" for x in ("src", "mixed", "up", "full"))
    job(DOC * 2, path, 0, save_cache=str(src))
    r = cli("convert-kv", src, mixed, "--kv-config", kvc)
    assert r.exit_code == 0, r.output
    rows = json.loads(cli("inspect-cache", mixed, "--json").stdout)["layers"]
    assert [row["bits"] for row in rows] == [4, None, 2] and rows[1]["codec"] == "full"
    _continue_matches_quantizing_at_the_prefix(path, model, tok, mixed, dict(kv_config=str(kvc)))
    r = cli("convert-kv", mixed, up, "--kv-bits", "8", "--kv-group-size", "32")
    assert r.exit_code == 0 and "does not restore" in r.stderr and "layers 0, 2" in r.stderr
    r = cli("convert-kv", up, full, "--full")
    assert r.exit_code == 0 and "does not restore" in r.stderr
    assert {row["codec"] for row in json.loads(cli("inspect-cache", full, "--json").stdout)["layers"]} == {"full"}
    got, _ = job(MORE, path, 8, load_cache=str(full))
    assert len(got.completions[0].token_ids) == 8


def test_inspect_table_with_model(loaded, tmp_path):
    path, _, _ = loaded("gemma3")
    f = tmp_path / "g.kv"
    job(DOC, path, 0, KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0), save_cache=str(f))
    r = cli("inspect-cache", f, "-m", path)
    assert r.exit_code == 0, r.output
    assert "window 16 " in r.stdout and "affine" in r.stdout and "prefix:" in r.stdout
    assert "Once upon a time" in r.stdout and "fits" in r.stdout
    other = cli("inspect-cache", f, "-m", loaded("llama")[0])
    assert "does not fit" in other.stdout and "gemma3_text with 4 layers" in other.stdout


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_mlx_lm_prompt_cache_is_inspected_and_continued(loaded, tmp_path, family):
    path, model, tok = loaded(family)
    ids = tok.encode(DOC)
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    f = tmp_path / "prompt_cache.safetensors"
    save_prompt_cache(str(f), cache, {"model": "tiny"})
    report = inspect_cache(f)
    assert report["format"] == "mlx-lm prompt cache" and report["metadata"] == {"model": "tiny"}
    kinds = {row["cache"]: row for row in report["layers"]}
    if "KVCache" in kinds:
        assert kinds["KVCache"]["tokens"] == len(ids) and kinds["KVCache"]["kind"] == "full"
    if "RotatingKVCache" in kinds:
        assert kinds["RotatingKVCache"]["kind"] == "window 16" and kinds["RotatingKVCache"]["tokens"] == 16
    if "ArraysCache" in kinds:
        assert kinds["ArraysCache"]["kind"] == "state" and kinds["ArraysCache"]["bytes"] > 0
    assert cli("inspect-cache", f).exit_code == 0
    # --load-cache converts it (windows and SSM state too) and continues as mlx-lm does from it
    r = cli("generate", "-m", path, "-p", MORE, "--load-cache", f, "-n", "6", "--json")
    assert r.exit_code == 0 and "continuing from an mlx-lm prompt cache" in r.stderr, r.output
    theirs, _ = mlx_lm_greedy(model, encode_continuation(tok, MORE), 6, load_prompt_cache(str(f)))
    stop = next((i for i, t in enumerate(theirs) if t in tok.eos_token_ids), len(theirs))
    assert json.loads(r.stdout.splitlines()[0])["token_ids"] == theirs[:stop]


def test_convert_refusals(loaded, tmp_path):
    path, _, _ = loaded("llama")
    src = tmp_path / "src.kv"
    job(DOC, path, 0, save_cache=str(src))
    for args, msg in ([(src, tmp_path / "o.kv"), "exactly one target"],
                      [(src, src, "--kv-bits", "4"), "is the input"],
                      [(src, tmp_path / "o.kv", "--kv-bits", "4", "--full"), "exactly one target"],
                      [(src, tmp_path / "o.kv", "--kv-bits", "7"), "--kv-bits"],
                      [(src, tmp_path / "no" / "o.kv", "--kv-bits", "4"), "does not exist"]):
        r = cli("convert-kv", *args)
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    kvc = tmp_path / "kv.json"
    kvc.write_text(json.dumps([{"layer_idx": 7, "bits": 4}]))
    r = cli("convert-kv", src, tmp_path / "o.kv", "--kv-config", kvc)
    assert r.exit_code == 1 and "layer_idx 7" in r.stderr
    assert not (tmp_path / "o.kv").exists()
