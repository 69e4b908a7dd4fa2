"""bench and fit under the `--kv` vocabulary: byte arithmetic against real caches.

For each tiny model and scheme, the caches a run builds are filled with T tokens through the
model itself; the sum of their nbytes must equal fit's `row_bytes` from config.json alone, and
bench must report those bytes and the codecs' bits per element.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache
from typer.testing import CliRunner

from backend_expect import mlx_lm_quantized_runs

from kvcore.attention import attention_context
from kvcore.bench import SHAPES
from kvcore.bench.fit import layer_bytes, layer_shapes, row_bytes, stored_tokens
from kvcore.bench.grid import scheme_policy
from kvcore.cache import CompressedKVCache
from kvcore.cache.compressed import TRIM_STEP
from kvcore.codecs import CodecSpec
from kvcore.policy import KVPolicy, build_caches
from mlxkv_cli.main import build_app

SCHEMES = ["affine:8", "affine:4", "turbo:k4v3", "turbo:4/r8", "affine:4/g32/r3", "affine:k8v4/g32", "turbo:2/r5"]
F32 = 4  # the fixtures' weights, hence their dense K/V, are float32


@pytest.fixture(scope="module")
def models(tiny_models, default_model_dir):
    loaded = {}

    def get(name):
        if name not in loaded:
            path = default_model_dir if name == "stories" else tiny_models(name)
            model, _ = load(str(path))
            loaded[name] = model, json.loads((path / "config.json").read_text())
        return loaded[name]

    return get


def filled_bytes(model, scheme: str, tokens: int) -> int:
    """Σ nbytes of the attention caches a run under `scheme` holds after `tokens` tokens."""
    policy = scheme_policy(scheme)
    caches, _ = build_caches(model, policy)
    ids = mx.random.randint(3, 500, (1, tokens), key=mx.random.key(tokens))
    with attention_context(model, required=policy.compresses):
        for i in range(0, tokens, 48):  # prefill in chunks, as a run does
            model(ids[:, i : i + 48], cache=caches)
            mx.eval([c.state for c in caches if isinstance(c, CompressedKVCache)])
    attn = [c for c in caches if isinstance(c, CompressedKVCache)]
    assert attn, "every attention layer of a compressing run is an mlxkv cache"
    return sum(c.nbytes for c in attn)


# stories: head_dim 8 (affine groups run over tokens: blocks of 32/64); llama: head_dim 16;
# qwen3: head_dim 64; gemma3/gemma4: sliding windows of 16 (tokens within window + TRIM_STEP - 1);
# gemma4: KV-shared layers and a global head_dim; qwen3_5: linear-attention layers.
@pytest.mark.parametrize("name,tokens", [("stories", 100), ("stories", 131), ("llama", 77), ("qwen3", 70),
                                         ("gemma3", 100), ("gemma3", 143), ("gemma4", 90), ("qwen3_5", 75)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fit_arithmetic_equals_nbytes_of_filled_caches(models, name, tokens, scheme):
    model, config = models(name)
    expected = row_bytes(layer_shapes(config), scheme_policy(scheme), tokens, F32)
    assert filled_bytes(model, scheme, tokens) == expected


def test_turbo_bytes_by_hand():
    s = layer_shapes(SHAPES["llama-8b"])[0]  # 8 KV heads, head_dim 128
    k4, v3 = CodecSpec("turbo", 4), CodecSpec("turbo", 3)
    # per head and token: 128 indices at 4 bits = 64 bytes (+2 for the norm); at 3 bits 48 (+2)
    assert layer_bytes(s, k4, v3, 1000) == 1000 * 8 * (66 + 50)
    # /r16: the 16 newest tokens stay bf16
    assert layer_bytes(s, k4, v3, 1000, 2, recent=16) == 984 * 8 * (66 + 50) + 16 * 8 * 128 * 2 * 2
    assert layer_bytes(s, k4, v3, 10, 2, recent=16) == 10 * 8 * 128 * 2 * 2
    # affine over tokens (head_dim 8, group 32): only complete blocks of 32 tokens are encoded
    tiny = type(s)("full-attention", None, 4, 8)
    a4 = CodecSpec("affine", 4, 32)
    assert layer_bytes(tiny, a4, a4, 100, 4, recent=3) == 96 * 4 * 8 * 2 * 5 / 8 + 4 * 4 * 8 * 2 * 4


def test_windows_count_the_drop_step_for_mlxkv_caches_only():
    gemma = layer_shapes(SHAPES["gemma3-12b"])
    window = next(s for s in gemma if s.kind == "window")
    assert stored_tokens(window, KVPolicy(), 10_000) == 1024  # mlx-lm's RotatingKVCache
    assert stored_tokens(window, scheme_policy("affine:4"), 10_000) == 1024 + TRIM_STEP - 1
    assert stored_tokens(window, scheme_policy("affine:4"), 500) == 500


def test_full_precision_names_keep_their_meaning(models):
    assert scheme_policy("bf16") == scheme_policy("fp16") == scheme_policy("full") == KVPolicy()
    model, config = models("llama")
    caches, _ = build_caches(model, scheme_policy("bf16"))
    assert all(type(c) is KVCache for c in caches)  # mlx-lm's own caches, in the model's dtype
    assert row_bytes(layer_shapes(config), scheme_policy("bf16"), 10, 2) == 10 * 3 * 2 * 16 * 2 * 2


def test_kv_config_scheme_equals_the_kv_config_flag(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps([{"layer_idx": 0, "codec": "turbo", "key_bits": 4, "value_bits": 3},
                               {"layer_idx": 1, "bits": 4, "group_size": 32}]))
    runner = CliRunner()
    args = ["fit", "--shape", "llama-8b", "--memory", "24GB", "--json", "--batch", "1", "--context", "8192"]
    a = runner.invoke(build_app(), [*args, "--kv", f"config:{cfg}"])
    b = runner.invoke(build_app(), [*args, "--kv", "full", "--kv-config", str(cfg)])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    rows_a = [r for r in json.loads(a.stdout)["rows"]]
    rows_b = [r for r in json.loads(b.stdout)["rows"] if r["scheme"] == "kv_config"]
    assert [{**r, "scheme": ""} for r in rows_a] == [{**r, "scheme": ""} for r in rows_b]
    policy = scheme_policy(f"config:{cfg}")
    shapes = layer_shapes(SHAPES["llama-8b"])
    dense = 8 * 128 * 2 * 2
    assert row_bytes(shapes, policy, 100, 2) == 100 * (8 * (66 + 50) + 8 * 128 * 2 * 5 / 8 + 30 * dense)


def test_fit_cli_takes_the_kv_vocabulary():
    r = CliRunner().invoke(build_app(), ["fit", "--shape", "llama-8b", "--memory", "24GB", "--json",
                                         "--kv", "full,turbo:k4v3,turbo:4/r128,affine:4/g32/r3", "--batch", "1"])
    assert r.exit_code == 0, r.output
    ctx = {row["scheme"]: row["max_batch"] for row in json.loads(r.stdout)["rows"] if row.get("context") == 32768}
    assert ctx["turbo:k4v3"] > ctx["affine:4/g32/r3"] > ctx["full"]


@pytest.mark.parametrize("kv,message", [
    ("zip:3", "unknown KV scheme 'zip:3' (accepted: full, bf16, fp16, fp32, affine:"),
    ("full:4", "unknown KV scheme 'full:4'"),
    ("turbo:9", "turbo bits must be one of"),
    ("turbo:4/g32", "unknown option 'g32'"),
    ("affine:4/r", "unknown option 'r'"),
])
def test_fit_bad_scheme_is_one_line(kv, message):
    r = CliRunner().invoke(build_app(), ["fit", "--shape", "llama-8b", "--memory", "24GB", "--kv", kv])
    assert r.exit_code == 1 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_bench_reports_nbytes_and_codec_bits(models, qwen3_bench):
    """qwen3: 2 layers, 2 KV heads, head_dim 64; 64 prompt + 4 generated tokens, the last never fed back."""
    schemes = ["full", "affine:8", "turbo:k4v3", "turbo:4/r8", "affine:4/g32/r3"]  # of conftest's run
    rows = {(x["scheme"], x["batch"], x["engine"]): x for x in qwen3_bench[0]["rows"]}
    model, config = models("qwen3")
    tokens, elements = 64 + 4 - 1, 2 * 2 * 64 * 2
    # codec arithmetic per K/V element: turbo 4 bits + a float16 norm per 64 (4.25), 3 bits likewise (3.25)
    by_hand = {"full": 32, "affine:8": 8.5, "turbo:k4v3": 3.75, "turbo:4/r8": (59 * 4.25 + 8 * 32) / 67,
               "affine:4/g32/r3": (64 * 5 + 3 * 32) / 67}
    for scheme in schemes:
        per_row = row_bytes(layer_shapes(config), scheme_policy(scheme), tokens, F32)
        if scheme != "full":
            assert filled_bytes(model, scheme, tokens) == per_row
        for batch in (1, 2):
            row = rows[(scheme, batch, "mlxkv")]
            assert row["kv_bytes"] == batch * per_row, (scheme, batch)
            assert row["bits_per_element"] == round(8 * per_row / (tokens * elements), 3) == round(by_hand[scheme], 3)
            assert row["vs_mlx_lm"] > 0  # against mlx-lm's own scheme, else its full-precision row
        base = rows[(scheme, 1, "mlx-lm")]
        runs = scheme == "full" or (scheme == "affine:8" and mlx_lm_quantized_runs(base.get("error")))
        assert ("error" in base) == (not runs), base  # CUDA: mlx-lm's affine:8 fails, asserted above
    assert "not supported" in rows[("turbo:k4v3", 1, "mlx-lm")]["error"]
