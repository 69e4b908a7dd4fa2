"""Admission by the one byte model (kvcore/cache/bytes.py), held against real caches.

- row bytes == Σ nbytes of real caches for every family, codec, window and recent setting;
- the engine refuses a row its real caches would overflow (windows included), where the old
  estimator (kept here as the negative control) admitted it;
- what admission reserves for uneven rows in one batch matches the measured memory increase;
- the model called with compressed caches needs no context manager.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from fixtures.tiny_models import FAMILIES
from kvcore.attention import attention_context
from kvcore.cache import CompressedKVCache
from kvcore.cache.bytes import KVByteModel
from kvcore.codecs import make_codec
from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.engine.memory import batch_need, default_kv_budget, model_bytes, transient_bytes, working_set
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.policy.plan import plan_layers

POLICIES = {
    "affine4": KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
    "turbo-recent": KVOptions(kv="turbo:k4v3/r5", quantized_kv_start=0),
    "window64-affine8": KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0, max_kv_size=64, keep=4),
    "window64": KVOptions(max_kv_size=64, keep=4),
}


@pytest.fixture(scope="module")
def models(tiny_models):
    loaded = {}

    def get(name):
        if name not in loaded:
            path = tiny_models(name)
            model, tok = load(str(path))
            loaded[name] = model, tok, json.loads((path / "config.json").read_text())
        return loaded[name]
    return get


def old_row_kv_bytes(config, plans, tokens, dtype_size):
    """The estimator admission used before the byte model (negative control): one head_dim
    and KV-head count for every layer, no windows' drop step, no sinks."""
    cfg = config.get("text_config", config)
    heads = cfg.get("num_attention_heads", 1)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(heads, 1)
    total = 0.0
    for p in plans:
        if p.kind == "other":
            continue
        t = min(tokens, p.window) if p.window else tokens
        per = [dtype_size if not s.compresses else make_codec(s, head_dim).bytes_per_token(1) / head_dim
               for s in (p.codec, p.values)]
        dense = min(t, p.recent)
        total += ((t - dense) * sum(per) / 2 + dense * dtype_size) * kv_heads * head_dim * 2
    return int(total)


def fill(model, policy, tokens: int) -> list:
    caches, _ = build_caches(model, policy)
    ids = mx.random.randint(3, 200, (1, tokens), key=mx.random.key(tokens))
    for i in range(0, tokens, 64):
        model(ids[:, i : i + 64], cache=caches)
        mx.eval([c.state for c in caches if isinstance(c, CompressedKVCache)])
    return caches


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(POLICIES))
def test_row_bytes_equal_real_caches(models, family, name):
    model, _, config = models(family)
    policy = resolve_policy(POLICIES[name])
    bm = KVByteModel(config, plan_layers(model, policy), 4, mlxkv=policy.active, chunk=64)
    caches = fill(model, policy, 300)
    real = sum(c.nbytes for c in caches if isinstance(c, CompressedKVCache))
    if any(c.window for c in caches if isinstance(c, CompressedKVCache)):
        assert real <= bm.row_bytes(300)  # a window holds up to its drop step and a chunk more
    else:
        assert bm.row_bytes(300) == real
    assert bm.row_alloc(300) >= real


def test_window_row_the_old_estimator_admits_is_refused(models):
    model, tok, config = models("gemma4")
    policy = resolve_policy(POLICIES["window64"])
    plans = plan_layers(model, policy)
    prompt = tuple(range(3, 203))
    final = len(prompt) + 4
    old = old_row_kv_bytes(config, plans, final, 4)
    real = sum(c.nbytes for c in fill(model, policy, final) if isinstance(c, CompressedKVCache))
    assert old < real  # what made the engine admit rows over budget
    engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=64), kv_budget=old,
                    batch_need=batch_need(config, plans, model, policy, 64))
    with pytest.raises(MlxkvError, match="can never fit"):
        engine.run([Request(prompt, 4, "a")])


def test_rows_wait_for_the_budget(models):
    model, tok, config = models("llama")
    policy = resolve_policy(POLICIES["affine4"])
    need = batch_need(config, plan_layers(model, policy), model, policy)
    reqs = [Request(tuple(range(3, 3 + n)), 6, str(i)) for i, n in enumerate((40, 60, 50, 30))]
    finals = [len(r.prompt_ids) + r.max_tokens for r in reqs]
    budget = need(sorted(finals)[-2:])  # any two rows fit, no three do
    assert need(sorted(finals)[:3]) > budget
    engine = Engine(model, tok, policy, 4, GenerateConfig(prefill_chunk=16), kv_budget=budget, batch_need=need)
    out = engine.run(reqs)
    assert max(len(t[1]) for t in engine.trace if t[0] == "decode") == 2  # the budget, not the batch size
    free = Engine(model, tok, policy, 4, GenerateConfig(prefill_chunk=16)).run(reqs)
    assert [c.token_ids for c in out] == [c.token_ids for c in free]


def kv_heavy_llama():
    """A llama whose KV dominates its transients (wide heads, few queries): 2 layers, head_dim 256."""
    from mlx_lm.models import llama

    config = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 256,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": True}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


@pytest.mark.parametrize("name,paged", [("full", None), ("affine4", False), ("affine4", True)],
                         ids=["full", "affine4-packed", "affine4-paged"])
def test_admitted_bytes_match_measured_memory_for_uneven_rows(name, paged):
    """Rows of 100 and 4 000 tokens in one batch: packed rows allocate B x the longest row, paged
    rows their own pages (and a spare one each); the byte model counts either within 10%."""
    from kvcore.attention.config import AttentionConfig

    model, config = kv_heavy_llama()
    policy = resolve_policy(KVOptions() if name == "full" else POLICIES["affine4"])
    plans = plan_layers(model, policy)
    need = batch_need(config, plans, model, policy, 32, paged=paged)
    reqs = [Request(tuple(int(t) % 250 + 3 for t in range(n)), 4, str(i)) for i, n in enumerate((4000, 100))]
    engine = Engine(model, None, policy, 2, GenerateConfig(prefill_chunk=32), interleave=False,
                    attention=AttentionConfig(paged=paged))
    mx.clear_cache()
    base = mx.get_active_memory()
    for r in reqs:
        engine.add_request(r)
    while not (len(engine.running) == 2 and all(len(s.out.token_ids) >= 2 for s in engine.running)):
        engine.step()
    mx.eval([c.state for c in engine.caches])
    mx.clear_cache()
    held = mx.get_active_memory() - base  # what the batch's caches hold (and the queued step's few bytes)
    bm = KVByteModel(config, plans, 4, mlxkv=policy.active, chunk=32, paged=paged)
    finals = [len(r.prompt_ids) + r.max_tokens for r in reqs]
    stored = sum(bm.row_bytes(n) for n in finals)
    if paged:  # pages hold each row's own tokens: within a page per row of what is stored
        assert stored < bm.batch_alloc(finals) < 1.2 * stored
        packed = KVByteModel(config, plans, 4, mlxkv=policy.active, chunk=32, paged=False)
        assert bm.batch_alloc(finals) < 0.6 * packed.batch_alloc(finals)
    else:
        assert bm.batch_alloc(finals) > 1.5 * stored  # the stored tokens alone undercount a packed batch
    assert 0.9 * bm.batch_alloc(finals) <= held <= 1.1 * bm.batch_alloc(finals), (held, bm.batch_alloc(finals))
    assert need(finals) >= bm.batch_alloc(finals) + bm.join_transient(finals)  # admission adds the join copy


def test_default_budget_leaves_weights_and_the_transient(models):
    model, _, _ = models("llama")
    total = working_set()
    assert default_kv_budget(model_bytes(model)) == total - model_bytes(model) - transient_bytes(total)


def test_compressed_caches_need_no_context(models):
    model, tok, _ = models("llama")
    policy = resolve_policy(POLICIES["affine4"])
    ids = mx.array([list(range(3, 40))])
    plain = model(ids, cache=build_caches(model, policy)[0])
    with attention_context(model):
        inside = model(ids, cache=build_caches(model, policy)[0])
    assert mx.array_equal(plain, inside).item()
