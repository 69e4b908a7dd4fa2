"""`mlxkv calibrate` on tiny models: the budget holds against real caches' bytes, a layer made
sensitive gets more bits, the file round-trips through --kv-config, optiq's format is kept
byte for byte, and bad budgets are one-line errors."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from typer.testing import CliRunner

from kvcore.calibrate import Budget, CalibrateJob, config_policy, run_calibrate
from kvcore.errors import MlxkvError
from kvcore.fidelity import teacher_forced_logprobs
from kvcore.fidelity.bytes import kv_bytes
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.policy.kv_config import load_kv_file
from mlxkv_cli.main import build_app

CORPUS = Path(__file__).resolve().parents[2] / "shared/assets/corpora/tinystories_val_head.txt"
STORY = ("Once upon a time there was a little girl named Lily. She liked to play with her big red ball in "
         "the park. One day she saw a big dog. The dog was sad because it lost its bone. ") * 12
FAST = dict(window_tokens=128, samples=1, queries=32, checks=1, dtype="float16")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("cal") / "story.txt"
    p.write_text(CORPUS.read_text()[20000:26000] if CORPUS.is_file() else STORY)
    return str(p)


def calibrate(model, text, budget, **kw):
    return run_calibrate(CalibrateJob((text,), budget, model=str(model), holdout=(text,), **{**FAST, **kw}))


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("llama")  # 3 layers, 2 KV heads, head_dim 16


@pytest.fixture(scope="module")
def at_4_bits(llama, text):
    return calibrate(llama, text, Budget(bits=4.0, context=200), candidates="full,affine:2..8,turbo:2..6,/r8")


def filled_bytes(model_dir, entries, tokens: int):
    """Deployed and held bytes of real caches under the config (entries, or a --kv label) after `tokens`
    teacher-forced tokens."""
    model, tok = load(str(model_dir))
    model.set_dtype(mx.float16)
    policy = resolve_policy(KVOptions(kv=entries, quantized_kv_start=0)) if isinstance(entries, str) else config_policy(entries)
    caches = build_caches(model, policy)[0]
    ids = (tok.encode(STORY) * 4)[:tokens]
    teacher_forced_logprobs(model, ids, caches, chunk=48)
    return kv_bytes(caches)


def test_bits_budget_is_honoured_against_real_caches(llama, at_4_bits):
    r = at_4_bits.report
    assert r["budget"]["context"] == 200
    got = filled_bytes(llama, at_4_bits.entries, 200)
    assert got.deployed == got.nbytes == r["bytes_per_row"]  # float16: held bytes are the deployed ones
    assert got.deployed <= r["budget"]["kv_bytes_per_row"] == int(4.0 * got.elements / 8)
    assert r["bits_per_element"]["200"] == pytest.approx(8 * got.deployed / got.elements)
    assert r["bits_per_element"]["200"] <= 4.0


def test_every_uniform_scheme_within_the_budget_is_listed(llama, at_4_bits):
    r = at_4_bits.report
    us = r["uniforms_within_budget"]
    assert len(us) > 10 and r["uniform"]["name"] == f"uniform {us[0]['scheme']}"
    assert [u["predicted_kl"] for u in us] == sorted(u["predicted_kl"] for u in us)
    assert all(u["bytes"] <= r["budget"]["kv_bytes_per_row"] and u["bits_per_element"] <= 4.0 for u in us)
    assert "affine:2/g64" in [u["scheme"] for u in us] and "affine:8/g64" not in [u["scheme"] for u in us]
    for u in (us[0], us[-1]):
        assert filled_bytes(llama, u["scheme"], 200).deployed == u["bytes"]


def test_memory_budget_is_honoured_against_real_caches(llama, text):
    model, _ = load(str(llama))
    model.set_dtype(mx.float16)  # as the run holds it
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    kv_room = 2 * (3 * 2 * 96 * 2 * 16 * 2) * 2 // 3  # two thirds of 2 rows of 96 full-precision tokens
    res = calibrate(llama, text, Budget(memory=weights + kv_room, context=96, batch=2), candidates="full,affine:2..8,turbo:2..8")
    got = filled_bytes(llama, res.entries, 96)
    assert got.deployed == res.report["bytes_per_row"] and 2 * got.deployed <= kv_room
    assert res.report["budget"]["kv_bytes_per_row"] == kv_room // 2 and res.report["budget"]["weights_bytes"] == weights
    assert got.deployed > kv_room // 2 - 3 * 2 * 96 * 2 * 16 * 2 // 8  # and the room is used, not wasted


def test_written_file_round_trips_through_kv_config(llama, at_4_bits, tmp_path):
    out, rep = tmp_path / "kv_config.json", tmp_path / "report.json"
    r = CliRunner().invoke(build_app(), ["calibrate", "-m", str(llama), "-t", at_4_bits.report["texts"][0],
                                         "--holdout", at_4_bits.report["texts"][0], "--bits", "4", "--context", "200",
                                         "--kv", "full,affine:2..8,turbo:2..6,/r8", "--window-tokens", "128",
                                         "--samples", "1", "--queries", "32", "--checks", "1", "--dtype", "float16",
                                         "-o", str(out), "--report", str(rep)])
    assert r.exit_code == 0, r.output
    written = json.loads(out.read_text())
    assert written == at_4_bits.entries  # the same seeds and texts choose the same config
    report = json.loads(rep.read_text())
    chosen = {x["layer"]: x["choice"] for x in report["layers"]}
    g = CliRunner().invoke(build_app(), ["generate", "-m", str(llama), "--kv-config", str(out), "-p", "Once upon",
                                         "-n", "3", "--json"])
    assert g.exit_code == 0, g.output
    summary = [json.loads(line) for line in g.stdout.splitlines() if line.startswith("{")][-1]
    plan = {p["layer"]: p for p in summary["plan"]}
    config = load_kv_file(out)
    for i, k, v in config.layers:
        assert (plan[i]["codec"], plan[i]["bits"], plan[i]["value"]["bits"]) == (k.name, k.bits, v.bits)
        assert plan[i]["recent"] == dict(config.recents).get(i, 0)
        assert chosen[i].startswith(k.name)
    for i in set(chosen) - {i for i, _, _ in config.layers}:
        assert chosen[i] == "full" and plan[i]["codec"] == "full"


def test_optiq_compatible_output_is_optiqs_format(llama, text):
    res = calibrate(llama, text, Budget(bits=5.0), optiq_compatible=True)
    from kvcore.calibrate import config_text
    text_out = config_text(res.entries)
    # optiq kv-cache writes: json.dump([{"layer_idx", "bits", "group_size"} ...], f, indent=2)
    optiq = [{"layer_idx": e["layer_idx"], "bits": e["bits"], "group_size": e["group_size"]} for e in res.entries]
    assert text_out == json.dumps(optiq, indent=2)
    assert all(list(e) == ["layer_idx", "bits", "group_size"] for e in res.entries)
    assert all(type(v) is int for e in res.entries for v in e.values())
    assert all(x["choice"] == "full" or x["choice"].startswith("affine:") and "k" not in x["choice"].split(":")[1]
               for x in res.report["layers"])


def _outlier_keys(src: Path, dst: Path, layer: int, factor: float = 40.0) -> Path:
    """The same model (the same logits at full precision) with one key channel pair of `layer` scaled by
    `factor` and the matching query channels by 1/factor: per-vector key codecs then lose that layer."""
    model, _ = load(str(src))
    attn = model.layers[layer].self_attn
    D, Hkv, Hq = 16, 2, 4
    kw, qw = attn.k_proj.weight, attn.q_proj.weight
    k_scale = mx.ones((Hkv * D, 1))
    q_scale = mx.ones((Hq * D, 1))
    for h in range(Hkv):
        for c in (3, 3 + D // 2):  # one RoPE pair: scaled alike, the rotation commutes with it
            k_scale[h * D + c] = factor
            for qh in range(h * Hq // Hkv, (h + 1) * Hq // Hkv):
                q_scale[qh * D + c] = 1 / factor
    attn.k_proj.weight, attn.q_proj.weight = kw * k_scale, qw * q_scale
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    return dst


def _key_bits(res) -> dict[int, int]:
    return {x["layer"]: 16 if x["choice"] == "full" else _kbits(x["choice"]) for x in res.report["layers"]}


def _kbits(label: str) -> int:
    bits = label.split(":")[1].split("/")[0]
    return int(bits[1:].split("v")[0]) if bits.startswith("k") else int(bits)


def test_a_layer_made_sensitive_gets_more_bits(llama, text, tmp_path):
    kw = dict(candidates="full,turbo:2..8")  # per-vector (affine at head_dim 16 groups each channel over tokens)
    plain = _key_bits(calibrate(llama, text, Budget(bits=4.5), **kw))
    sharp = _key_bits(calibrate(_outlier_keys(llama, tmp_path / "outlier", 1), text, Budget(bits=4.5), **kw))
    assert sharp[1] > plain[1] and sharp[1] > max(sharp[0], sharp[2]), (plain, sharp)


def cli(*args):
    return CliRunner().invoke(build_app(), ["calibrate", *map(str, args)])


@pytest.mark.parametrize("args,message", [
    (["--bits", "0"], "--bits must be in (0, 16], got 0"),
    (["--bits", "17"], "--bits must be in (0, 16], got 17"),
    (["--memory", "1KB", "--context", "128"], "is below the model's weights"),
    (["--memory", "1GB"], "--memory needs --context"),
    (["--bits", "4", "--memory", "1GB"], "give one budget"),
    ([], "give one budget"),
    (["--bits", "4", "--kv", "lz4:2..8"], "unknown codec 'lz4'"),
    (["--bits", "4", "--kv", "turbo:2..8", "--optiq-compatible"], "not in optiq's format"),
    (["--bits", "0.1", "--kv", "affine:2..8"], "below the smallest candidate config"),
])
def test_bad_budgets_are_one_line_errors(llama, text, tmp_path, args, message):
    r = cli("-m", llama, "-t", text, "-o", tmp_path / "out.json", "--window-tokens", "128", "--samples", "1",
            "--queries", "16", *args)
    assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out.json").exists()


def test_empty_text_is_a_one_line_error(llama, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    r = cli("-m", llama, "-t", empty, "-o", tmp_path / "out.json", "--bits", "4")
    assert r.exit_code == 1 and f"text file is empty: {empty}" in r.output and len(r.output.strip().splitlines()) == 1


def test_sensitivities_are_reused_for_another_budget(llama, text, at_4_bits, tmp_path):
    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(at_4_bits.report))
    again = calibrate(llama, text, Budget(bits=3.0, context=200), candidates="full,affine:2..8,turbo:2..6,/r8",
                      sensitivities=str(rep))
    assert again.report["sensitivities_from"] == str(rep)
    assert [x["sensitivity"] for x in again.report["layers"]] == [x["sensitivity"] for x in at_4_bits.report["layers"]]
    assert again.report["bytes_per_row"] <= again.report["budget"]["kv_bytes_per_row"] < at_4_bits.report["bytes_per_row"]
    with pytest.raises(MlxkvError, match="measured with another window_tokens"):
        calibrate(llama, text, Budget(bits=3.0), window_tokens=96, sensitivities=str(rep))
    with pytest.raises(MlxkvError, match="has no affine:2/g32"):
        calibrate(llama, text, Budget(bits=8.0, context=200), candidates="affine:2/g32", sensitivities=str(rep))
