"""--adapter-path (issue 18): mlx-lm LoRA adapter folders loaded through mlx-lm, with full and
compressed KV, alone and batched; folders that do not fit are one-line errors."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import linear_to_lora_layers
from typer.testing import CliRunner

from mlxkv_cli.main import build_app

PROMPTS = ["Once upon a time", "The dog ran"]


def make_adapter(model_dir, out, rank=4, seed=0):
    """A LoRA adapter for the model in `model_dir` whose B matrices are not zero (so it changes
    the output), written as mlx-lm writes one."""
    model, _ = mlx_lm_load(str(model_dir))
    params = {"rank": rank, "scale": 4.0, "dropout": 0.0}
    model.freeze()  # as mlx-lm trains: only the LoRA matrices are adapter weights
    linear_to_lora_layers(model, len(model.layers), params)
    mx.random.seed(seed)
    weights = {k: (mx.random.normal(v.shape) * 0.5 if k.endswith("lora_b") else v)
               for k, v in tree_flatten(model.trainable_parameters())}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}))
    return out


@pytest.fixture(scope="module")
def llama_adapter(tiny_models, tmp_path_factory):
    return make_adapter(tiny_models("llama"), tmp_path_factory.mktemp("adapters") / "llama-lora")


def run(args):
    r = CliRunner().invoke(build_app(), ["generate", "-n", "10", "--json", "--no-chat-template"] + args)
    assert r.exit_code == 0, r.output
    return [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if '"completion"' in x]


def test_adapter_changes_the_output_as_mlx_lm_does(tiny_models, llama_adapter):
    m = str(tiny_models("llama"))
    plain = run(["-m", m, "-p", PROMPTS[0]])[0]
    adapted = run(["-m", m, "-p", PROMPTS[0], "--adapter-path", str(llama_adapter)])[0]
    model, tok = mlx_lm_load(m, adapter_path=str(llama_adapter))
    ref = [int(t) for t, _ in generate_step(mx.array(tok.encode(PROMPTS[0])), model, max_tokens=10)]
    assert adapted == ref and adapted != plain
    # compressed KV and batched rows carry the adapter: each row == its run alone
    kv = ["--kv", "affine:8/g32"]
    alone = [run(["-m", m, "-p", p, "--adapter-path", str(llama_adapter)] + kv)[0] for p in PROMPTS]
    batched = run(["-m", m, "-p", PROMPTS[0], "-p", PROMPTS[1], "--adapter-path", str(llama_adapter)] + kv)
    assert batched == alone and alone[0] != run(["-m", m, "-p", PROMPTS[0]] + kv)[0]


def test_adapters_that_do_not_fit_are_one_line(tiny_models, llama_adapter, tmp_path):
    other = make_adapter(tiny_models("qwen3"), tmp_path / "qwen3-lora")  # another model's shapes
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{nope")
    (broken / "adapters.safetensors").write_bytes(b"")
    m = str(tiny_models("llama"))
    for path, msg in [(other, "does not fit this model"), (tmp_path / "missing", "not a folder"),
                      (broken, "is not JSON")]:
        r = CliRunner().invoke(build_app(), ["generate", "-m", m, "-p", "Once", "-n", "2", "--adapter-path", str(path)])
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
