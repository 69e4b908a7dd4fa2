"""save -> load -> continue gives the tokens of one uninterrupted greedy run."""

import json

import pytest

from helpers import ours, per_family
from kvcore.engine.prompt import encode_continuation, encode_prompt
from kvcore.policy import KVOptions
from kvcore.store import open_cache_file
from store_helpers import DOC, MORE, job

N = 20


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (path, model, tok))


@pytest.fixture(scope="module")
def kv_config(tmp_path_factory):
    p = tmp_path_factory.mktemp("kvc") / "kv_config.json"
    p.write_text(json.dumps([{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 2, "bits": 8}]))
    return str(p)


CASES = [
    ("llama", {}),  # mlx-lm's KVCache
    ("llama", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)),  # head_dim 16: token layout
    ("qwen3", dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0)),  # head_dim 64: channel layout
    ("qwen3", dict(kv_bits=4, kv_group_size=32, quantized_kv_start=20)),  # converts inside the prompt
    ("llama", "kv_config"),
    ("llama", dict(max_kv_size=16, keep=2)),  # wrapped window
    ("llama", dict(max_kv_size=24, keep=2, kv_bits=4, kv_group_size=32, quantized_kv_start=0)),
    ("gemma3", {}),  # mlx-lm's RotatingKVCache on local layers
    ("gemma3", dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)),
    ("gemma4", {}),
    ("gemma4", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)),
    ("qwen3_5", {}),  # SSM state saved and restored
    ("qwen3_5", dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)),
    ("qwen3", dict(kv="turbo:k4v3")),
    ("llama", dict(kv="turbo:4/r5", quantized_kv_start=20)),  # recent tokens dense, converts inside the prompt
    ("gemma3", dict(kv="turbo:k8v3/r3")),  # compressed windows with recent tokens
]


def _opts(spec, kv_config) -> KVOptions:
    return KVOptions(kv_config=kv_config) if spec == "kv_config" else KVOptions(**spec)


@pytest.mark.parametrize("family,spec", CASES, ids=lambda x: x if isinstance(x, str) else
                         ("-".join(f"{k}{v}" for k, v in x.items()) or "plain"))
def test_save_load_continue_equals_one_run(loaded, kv_config, tmp_path, family, spec):
    path, model, tok = loaded(family)
    opts, f = _opts(spec, kv_config), tmp_path / "run.kv"
    first, _ = job(DOC, path, 6, opts, save_cache=str(f))
    cached = open_cache_file(f).prefix_ids
    c = first.completions[0]
    assert c.finish_reason == "length" and cached == encode_prompt(tok, DOC) + c.token_ids[:-1]
    again, notices = job(MORE, path, N, opts, load_cache=str(f))
    ref, _ = ours(model, tok, cached + encode_continuation(tok, MORE), N, opts)
    assert again.completions[0].token_ids == ref and len(ref) >= 8
    assert not [n for n in notices if "KV policy" in n or "cannot reuse" in n]
    assert again.completions[0].prompt_tokens == len(encode_continuation(tok, MORE))


def test_window_that_dropped_tokens_continues(loaded, tmp_path):
    """A compressed window past TRIM_STEP (old tokens dropped) saves and continues exactly."""
    path, model, tok = loaded("llama")
    opts, f = KVOptions(max_kv_size=16, keep=2, kv_bits=8, kv_group_size=32, quantized_kv_start=0), tmp_path / "w.kv"
    job(DOC * 6, path, 4, opts, save_cache=str(f))
    cf = open_cache_file(f)
    e = cf.layers[0]
    assert (e["enc_start"] if e["enc"] else e["tail_start"]) > e["keep"]  # old tokens were dropped
    again, _ = job(MORE, path, N, opts, load_cache=str(f))
    assert again.completions[0].token_ids == ours(model, tok, cf.prefix_ids + encode_continuation(tok, MORE), N, opts)[0]


@pytest.mark.parametrize("family,spec", [("llama", {}), ("llama", dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)),
                                         ("qwen3", dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0))])
def test_full_prompt_reuses_the_cached_prefix(loaded, tmp_path, family, spec):
    """--prompt-file: a prompt that extends, equals or diverges from the cached one."""
    path, _, tok = loaded(family)
    opts, f = KVOptions(**spec), tmp_path / "doc.kv"
    job(DOC, path, 0, opts, save_cache=str(f))
    n_doc = len(open_cache_file(f).prefix_ids)
    for prompt in (DOC + MORE, DOC, DOC[:40] + " and a cat"):
        ref, _ = job(prompt, path, N, opts)
        got, notices = job(prompt, path, N, opts, load_cache=str(f), continue_mode="full")
        assert got.completions[0].token_ids == ref.completions[0].token_ids
        reused = got.summary["kv_policy"]["reused_tokens"]
        assert 0 < reused <= n_doc and got.completions[0].prompt_tokens == len(encode_prompt(tok, prompt)) - reused
        assert ("diverges" in " ".join(notices)) == (reused < n_doc)


@pytest.mark.parametrize("family,why", [("gemma3", "sliding window"), ("qwen3_5", "SSM")])
def test_untrimmable_caches_reprefill_and_say_so(loaded, tmp_path, family, why):
    path, _, _ = loaded(family)
    f = tmp_path / "doc.kv"
    job(DOC, path, 0, save_cache=str(f))
    prompt = DOC[:30] + " and a cat"
    ref, _ = job(prompt, path, N)
    got, notices = job(prompt, path, N, load_cache=str(f), continue_mode="full")
    assert got.completions[0].token_ids == ref.completions[0].token_ids
    assert any("cannot reuse" in n and why in n for n in notices)
    assert got.summary["kv_policy"]["reused_tokens"] == 0


def test_flags_that_disagree_with_the_cache_get_a_note(loaded, tmp_path):
    path, _, _ = loaded("llama")
    f = tmp_path / "q.kv"
    job(DOC, path, 0, KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0), save_cache=str(f))
    got, notices = job(MORE, path, 4, KVOptions(kv_bits=8), load_cache=str(f))
    assert any("using the cache's KV policy (affine:4/g32)" in n for n in notices)
    assert got.summary["kv_policy"]["codec"] == "affine:4/g32"


def test_saving_after_eos_records_the_eos_token(loaded, tmp_path, monkeypatch):
    """The EOS that ends a run is fed to the caches, so the saved prefix lists it."""
    path, _, tok = loaded("llama")
    f = tmp_path / "e.kv"
    first, _ = job(DOC, path, 12)
    eos = first.completions[0].token_ids[3]
    import mlx_lm.tokenizer_utils as tu

    monkeypatch.setattr(tu.TokenizerWrapper, "eos_token_ids", property(lambda self: {eos}), raising=False)
    r, _ = job(DOC, path, 12, save_cache=str(f))
    c = r.completions[0]
    assert c.finish_reason == "eos" and c.eos_token == eos
    assert open_cache_file(f).prefix_ids == encode_prompt(tok, DOC) + c.token_ids + [eos]


@pytest.mark.parametrize("kw", [dict(window=None), dict(window=20, keep=2), dict(window=12, keep=0, start=4)])
def test_compressed_cache_state_protocol_round_trip(kw):
    """mlx-lm's protocol: from_state(state, meta_state) rebuilds a cache that continues identically
    (and setting `state` before `meta_state`, as older mlx-lm does, works too)."""
    import mlx.core as mx

    from kvcore.cache import CompressedKVCache
    from kvcore.codecs import CodecSpec

    spec = CodecSpec("affine", 4, 32)
    mx.random.seed(0)
    k, v = mx.random.normal((1, 2, 300, 16)), mx.random.normal((1, 2, 300, 16))
    a = CompressedKVCache(spec, start=kw.get("start", 0), window=kw["window"], keep=kw.get("keep", 0))
    a.update_and_fetch(k[:, :, :150], v[:, :, :150])
    a.update_and_fetch(k[:, :, 150:151], v[:, :, 150:151])
    b = CompressedKVCache.from_state(a.state, a.meta_state)
    c = CompressedKVCache.__new__(CompressedKVCache)
    c.state, c.meta_state = a.state, a.meta_state
    assert b.layout() == a.layout() == c.layout() and b.nbytes == a.nbytes
    for cache in (a, b, c):
        cache.update_and_fetch(k[:, :, 151:230], v[:, :, 151:230])
        cache.trim(5)
    for x, y, z in zip(a.state, b.state, c.state):
        assert mx.array_equal(x, y).item() and mx.array_equal(x, z).item()


def test_chat_continue_renders_a_user_turn_without_bos():
    class Tok:
        chat_template, bos_token = "x", "<s>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return f"<s>[USER]{messages[0]['content']}[/USER]"

        def encode(self, text, add_special_tokens=True):
            return [ord(ch) for ch in text]

    assert encode_continuation(Tok(), "hi", chat=True) == [ord(ch) for ch in "[USER]hi[/USER]"]
    assert encode_continuation(Tok(), "hi") == [ord("h"), ord("i")]
