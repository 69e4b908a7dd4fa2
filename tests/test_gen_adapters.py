"""--adapter-path (issue 18): mlx-lm LoRA adapter folders loaded through mlx-lm, with full and
compressed KV, alone and batched; folders that do not fit are one-line errors."""

import json

import mlx.core as mx
import pytest
from fixtures.lora import make_adapter
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from mlxkv_cli.main import build_app

PROMPTS = ["Once upon a time", "The dog ran"]


@pytest.fixture(scope="module")
def llama_adapter(tiny_models, tmp_path_factory):
    # dropout as trained: inference must not apply it (mlx-lm's load puts the model in eval mode)
    return make_adapter(tiny_models("llama"), tmp_path_factory.mktemp("adapters") / "llama-lora", dropout=0.3)


def run(args):
    r = CliRunner().invoke(build_app(), ["generate", "-n", "10", "--json", "--no-chat-template"] + args)
    assert r.exit_code == 0, r.output
    return [c["token_ids"] for c in sorted((json.loads(x) for x in r.stdout.splitlines() if '"completion"' in x),
                                          key=lambda c: int(c["id"]))]  # printed as rows finish


def test_adapter_changes_the_output_as_mlx_lm_does(tiny_models, llama_adapter):
    m = str(tiny_models("llama"))
    plain = run(["-m", m, "-p", PROMPTS[0]])[0]
    adapted = run(["-m", m, "-p", PROMPTS[0], "--adapter-path", str(llama_adapter)])[0]
    model, tok = mlx_lm_load(m, adapter_path=str(llama_adapter))
    ref = [int(t) for t, _ in generate_step(mx.array(tok.encode(PROMPTS[0])), model, max_tokens=10)]
    eos = set(tok.eos_token_ids)
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]  # generate stops there, as mlx-lm's does
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
