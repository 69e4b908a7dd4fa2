"""LoRA adapters in serve (`--lora-modules NAME=DIR`, vLLM's flag): each name is a model id; a
request naming one runs that adapter for its rows, batched beside rows of the base model and of
other adapters, and returns exactly what `mlxkv generate --adapter-path DIR` returns for that
prompt alone (greedy; a tiny llama, 8-bit KV from token 0). The prefix cache (RAM and disk) keys
entries by adapter as well as tokens: a prompt cached under one adapter is never reused for
another or the base. Bad --lora-modules values are one line at startup."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from fixtures.lora import make_adapter
from typer.testing import CliRunner

from serve_helpers import get, metric
from kvcore.adapter_set import AdapterSet
from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.models import load_model
from kvcore.policy import KVOptions, resolve_policy
from kvcore.serve.server import EXTRA_MODULES
from mlxkv_cli.main import build_app

for _extra in EXTRA_MODULES:
    pytest.importorskip(_extra)
openai = pytest.importorskip("openai")

KV_FLAGS = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
KV = KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
CHUNK = 4
N = 8
PROMPTS = ["Once upon a time", "The dog ran", "She liked to play", "Tom and Lily"]
SAME = "A big cat sat on the mat and"  # asked under every adapter, one after another


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-adapters")
    m = tiny_models("llama")
    one = make_adapter(m, root / "one", seed=2)
    two = make_adapter(m, root / "two", rank=2, seed=1, keys=["self_attn.v_proj", "mlp.down_proj"])
    return str(m), {"one": str(one), "two": str(two)}, root


def generate(model: str, prompt: str, adapter: str | None) -> str:
    """`mlxkv generate --adapter-path DIR` for this prompt alone: its text."""
    args = ["generate", "-m", model, "-p", prompt, "-n", str(N), "--json", "--no-chat-template",
            "--prefill-chunk", str(CHUNK), *KV_FLAGS] + (["--adapter-path", adapter] if adapter else [])
    r = CliRunner().invoke(build_app(), args)
    assert r.exit_code == 0, r.output
    (c,) = [json.loads(x) for x in r.stdout.splitlines() if '"completion"' in x]
    assert len(c["token_ids"]) == N
    return c["text"]


@pytest.fixture(scope="module")
def server(setup):
    from kvcore.serve import ServeConfig, start_server

    model, adapters, _ = setup
    h = start_server(ServeConfig(model=model, kv=KV, port=0, batch_size=4, prefill_chunk=CHUNK,
                                 prefix_cache_bytes=64 * 2**20, lora_modules=tuple(adapters.items())))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, model: str, prompt: str):
    return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)


def test_models_lists_the_base_and_each_adapter(server, client):
    base = server.served.name
    cards = client.models.list().data
    assert [m.id for m in cards] == [base, "one", "two"]
    assert [getattr(m, "parent", None) for m in cards] == [None, base, base]
    assert client.models.retrieve("two").id == "two"
    with pytest.raises(openai.NotFoundError, match="'three' does not exist.*'one', 'two'"):
        ask(client, "three", PROMPTS[0])


def test_adapter_rows_batched_with_base_rows_equal_each_alone(setup, server, client):
    model, adapters, _ = setup
    rows = [(PROMPTS[0], None), (PROMPTS[1], "one"), (PROMPTS[2], "two"), (PROMPTS[0], "one"),
            (PROMPTS[3], None), (PROMPTS[0], "two"), (PROMPTS[3], "one"), (PROMPTS[1], None)]
    want = [generate(model, p, adapters.get(a)) for p, a in rows]
    assert want[0] != want[3] != want[5] and want[4] != want[6]  # the adapters change the output
    base = server.served.name
    with ThreadPoolExecutor(len(rows)) as pool:
        got = list(pool.map(lambda r: ask(client, r[1] or base, r[0]), rows))
    assert [r.choices[0].text for r in got] == want
    assert [r.model for r in got] == [a or base for _, a in rows]  # each response names its model
    assert all(r.usage.completion_tokens == N for r in got)
    assert metric(get(server.url, "/metrics")[1], "running_rows_peak") >= 3  # batched, mixed


def test_a_prompt_cached_under_one_adapter_is_not_reused_for_another(setup, server, client):
    model, adapters, _ = setup
    base, later = server.served.name, SAME + " a dog"
    got = {}
    for name in ("one", "two", base):  # one after another: each finds the earlier ones' prompts cached
        r = ask(client, name, SAME)
        assert r.usage.prompt_tokens_details.cached_tokens == 0, name
        got[name] = r.choices[0].text
    assert got == {name: generate(model, SAME, adapters.get(name)) for name in ("one", "two", base)}
    assert len(set(got.values())) == 3
    r = ask(client, "two", later)  # its own adapter's prompt is reused
    assert r.usage.prompt_tokens_details.cached_tokens > 4
    assert r.choices[0].text == generate(model, later, adapters["two"])
    chunks = list(client.completions.create(model="one", prompt=SAME, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == got["one"]  # streamed, from its cache
    assert {c.model for c in chunks} == {"one"}


def test_the_disk_tier_keys_files_by_adapter(setup, tmp_path):
    from kvcore.engine import generate_one
    from kvcore.policy import build_caches
    from kvcore.serve.adapters import adapter_fingerprints
    from kvcore.serve.prefix import PrefixCache
    from kvcore.serve.spill import PrefixDisk, serve_fingerprint
    from kvcore.store import model_fingerprint

    model, adapters, _ = setup
    one, two = adapters["one"], adapters["two"]
    lm = load_model(model)
    AdapterSet(lm.model, [one, two])
    tok, policy = lm.tokenizer, resolve_policy(KV)
    ids = tuple(tok.encode(SAME))
    later = ids + (30, 31, 32)

    def engine(folders):
        e = Engine(lm.model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK))
        fp = serve_fingerprint(model_fingerprint(lm.model, tok, lm.config), None, e.runner.new_caches())
        e.prefix = PrefixCache(0, e.runner.new_caches, PrefixDisk(tmp_path, 2**30, fp, adapter_fingerprints(fp, folders)))
        return e  # no RAM: every prompt is written through to the folder

    a = engine([one, two])
    a.run([Request(ids, 2, "a", adapter=one)])
    assert len(list(tmp_path.glob("*.kv"))) == 1
    b = engine([one, two])  # a fresh server over the folder
    out = b.run([Request(later, N, "b", adapter=two)])[0]
    assert b.prefix.hits == 0 and b.prefix.disk.loads == 0  # one's file is never read for two
    assert len({p.name[:16] for p in tmp_path.glob("*.kv")}) == 2  # a tag per adapter
    assert b.prefix.disk.best(None, list(later)) == ((), 0)  # nor for the base model
    want = generate_one(lm.model, tok, Request(later, N, adapter=two), build_caches(lm.model, policy)[0],
                        GenerateConfig(prefill_chunk=CHUNK)).token_ids
    assert out.token_ids == want
    out = b.run([Request(later, N, "c", adapter=one)])[0]
    assert b.prefix.disk_hits == 1 and b.prefix.reused == {"c": len(ids)}  # its own adapter's file is
    assert out.token_ids == generate_one(lm.model, tok, Request(later, N, adapter=one),
                                         build_caches(lm.model, policy)[0], GenerateConfig(prefill_chunk=CHUNK)).token_ids
    (tmp_path / "one-retrained").mkdir()
    retrained = make_adapter(model, tmp_path / "one-retrained" / "a", seed=5)  # other weights, another folder
    c = engine([str(retrained)])
    assert c.prefix.disk.best(str(retrained), list(later)) == ((), 0)  # files follow the weights, not the name


def serve_cli(*args):
    r = CliRunner().invoke(build_app(), ["serve", "--port", "0", *args])
    return r.exit_code, r.output.strip()


def test_bad_lora_modules_are_one_line_at_startup(setup, tiny_models, tmp_path):
    model, adapters, root = setup
    cases = [
        (["--lora-modules", "one"], "expected NAME=DIR"),
        (["--lora-modules", "one=" + adapters["one"], "two=" + str(tmp_path / "missing")], "missing: not a folder"),
        (["--lora-modules", "one=" + adapters["one"], "--lora-modules", "one=" + adapters["two"]], "given twice"),
        (["--lora-modules", "=" + adapters["one"]], "the name must be non-empty"),
        (["--lora-modules", "one="], "no adapter folder"),
    ]
    for args, msg in cases:
        code, err = serve_cli("-m", model, *args)
        assert code == 1 and err.startswith("error: --lora-modules") and msg in err and "\n" not in err, (args, err)
    other = make_adapter(tiny_models("qwen3"), root / "for-qwen3", seed=2)
    code, err = serve_cli("-m", model, "--lora-modules", f"one={adapters['one']}", f"q={other}")
    assert code == 1 and "\n" not in err and err.startswith(f"error: --lora-modules {other} does not fit this model")
    code, err = serve_cli("-m", model, "--served-model-name", "one", "--lora-modules", f"one={adapters['one']}")
    assert code == 1 and "\n" not in err and "the name is the base model's id" in err, err


def test_several_values_after_one_flag_are_spread():
    from mlxkv_cli.serve import LORA_FLAG as F
    from mlxkv_cli.serve import spread_values

    assert spread_values([F, "a=x", "b=y", "--port", "0"], F) == [F, "a=x", F, "b=y", "--port", "0"]
    assert spread_values([F + "=a=x", "b=y", F, "c=z"], F) == [F + "=a=x", F, "b=y", F, "c=z"]
    for unchanged in (["--port", "0", "b=y"], [F, "a=x", "--", "b=y"], [F]):
        assert spread_values(unchanged, F) == unchanged
