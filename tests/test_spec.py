"""Speculative decoding on the tiny models: token-identical to plain greedy decoding under
every cache kind, with a draft model and with prompt lookup, alone and in mixed batches."""

import json
import random
import shutil
from contextlib import ExitStack
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm import load

from fixtures.tiny_models import FAMILIES
from helpers import ROW_PROMPTS as PROMPTS, per_family
from kvcore.attention import attention_context
from kvcore.cache import CompressedKVCache
from kvcore.engine import GenerateConfig, Request, generate_one, prefill
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.speculative import DraftProvider, ModelDraft, PromptLookup, Proposal, SpecEngine
from kvcore.speculative.rows import Checkpoint, feed, offsets, pad, rollback

CHUNK = 8
KINDS = {
    "full": KVOptions(),
    "affine8": KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0),
    # start 13: long prompts cross it in prefill, "Tom" and "The dog" inside a speculative round
    "affine4-delayed": KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=13),
    "window": KVOptions(max_kv_size=10, keep=2),
    "window-affine8": KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0, max_kv_size=10, keep=2),
}


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (
        model, tok, [Request(tuple(tok.encode(p)), 8 + 4 * i, str(i)) for i, p in enumerate(PROMPTS)]))


def plain(model, tok, reqs, policy):
    cfg = GenerateConfig(prefill_chunk=CHUNK)
    with attention_context(model):
        return [generate_one(model, tok, r, build_caches(model, policy)[0], cfg).token_ids for r in reqs]


def speculative(model, tok, reqs, policy, draft, k=4, batch_size=4, engine_hook=None, **kwargs):
    engine = SpecEngine(model, tok, policy, draft, k, batch_size, GenerateConfig(prefill_chunk=CHUNK), **kwargs)
    if engine_hook:
        engine_hook(engine)
    with ExitStack() as stack:
        for m in draft.models:
            stack.enter_context(attention_context(m))
        stack.enter_context(attention_context(model))
        out = engine.run(reqs)
    return [c.token_ids for c in out], engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["full", "affine4-delayed", "window-affine8"])
def test_greedy_speculative_equals_plain(loaded, family, kind):
    """Model as its own draft (accepts everything) and prompt lookup (mostly rejected)."""
    model, tok, reqs = loaded(family)
    policy = resolve_policy(KINDS[kind])
    ref = plain(model, tok, reqs, policy)
    got, engine = speculative(model, tok, reqs, policy, ModelDraft(model, policy))
    assert got == ref
    assert engine.stats.accepted == engine.stats.drafted > 0  # the target drafting for itself
    got, engine = speculative(model, tok, reqs, policy, PromptLookup())
    assert got == ref
    assert max(len(t[1]) for t in engine.trace if t[0] == "decode") >= 2  # rows really shared rounds


@pytest.mark.parametrize("kind", ["affine8", "window"])
def test_more_cache_kinds_single_row_and_batched(loaded, kind):
    model, tok, reqs = loaded("llama")
    policy = resolve_policy(KINDS[kind])
    ref = plain(model, tok, reqs, policy)
    for batch_size in (1, 4):
        assert speculative(model, tok, reqs, policy, ModelDraft(model, policy), batch_size=batch_size)[0] == ref
        assert speculative(model, tok, reqs, policy, PromptLookup(), batch_size=batch_size)[0] == ref


class RandomDraft(DraftProvider):
    """Random tokens, a random number per row (0 .. cap): most rounds reject early."""

    def __init__(self, vocab=512, seed=0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, contexts, caps):
        return Proposal([[self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, k))] for k in caps])


@pytest.mark.parametrize("family,draft_family", [("qwen3_5", "qwen3_5"), ("llama", "qwen3_5"), ("gemma4", "gemma3")])
def test_other_drafts_still_give_identical_output(loaded, family, draft_family):
    """A random draft and another model as draft; qwen3_5's SSM state is checkpointed,
    restored and replayed on the rows that rejected (target and draft side)."""
    model, tok, reqs = loaded(family)
    policy = resolve_policy(KINDS["affine4-delayed"])
    ref = plain(model, tok, reqs, policy)
    got, engine = speculative(model, tok, reqs, policy, RandomDraft())
    assert got == ref
    assert (engine.stats.replays > 0) == (family == "qwen3_5")
    if draft_family != family:
        draft_model = loaded(draft_family)[0]
        assert speculative(model, tok, reqs, policy, ModelDraft(draft_model, policy))[0] == ref


def test_ssm_state_is_restored_and_replayed(loaded):
    """qwen3_5: two rows feed 4 tokens, keep 2 and 4; row 0's SSM state is the checkpoint's
    plus its 2 kept tokens, as if the other 2 had never been fed."""
    model, tok, reqs = loaded("qwen3_5")
    policy = replace(resolve_policy(KVOptions()), rollback=0)

    def two_rows():
        rows = []
        for r in reqs[:2]:
            caches, _ = build_caches(model, policy)
            prefill(model, list(r.prompt_ids), caches)
            rows.append([type(c).merge([c]) for c in caches])
        for mine, other in zip(*rows):
            mine.extend(other)
        return rows[0]

    with attention_context(model):
        spec, ref = two_rows(), two_rows()
        fed = [[5, 6, 7, 8], [9, 10, 11, 12]]
        ckpt = Checkpoint.take(spec)
        feed(model, spec, *pad(fed))
        assert rollback(model, spec, fed, [2, 4], ckpt) == 1
        feed(model, ref, *pad([[5, 6], [9, 10, 11, 12]]))
        assert offsets(spec) == offsets(ref)
        a, b = (feed(model, c, *pad([[13], [13]])) for c in (spec, ref))
    assert mx.allclose(a, b, atol=1e-4).item()


class ScriptedDraft(DraftProvider):
    """Per row (by prompt): right tokens, wrong tokens, one right then wrong, or none."""

    def __init__(self, refs: dict, vocab=512):
        self.refs, self.vocab = refs, vocab  # prompt -> (reference continuation, mode)

    def propose(self, contexts, caps):
        out = []
        for ctx, k in zip(contexts, caps):
            prompt = next(p for p in self.refs if tuple(ctx[: len(p)]) == p)
            ref, mode = self.refs[prompt]
            true = ref[len(ctx) - len(prompt):][:k]
            wrong = [(t + 1) % self.vocab for t in true]
            out.append({"right": true, "wrong": wrong, "mixed": true[:1] + wrong[1:], "none": []}[mode])
        return Proposal(out)


def test_rows_roll_back_by_their_own_amounts(loaded):
    model, tok, reqs = loaded("llama")
    reqs = [Request(r.prompt_ids, 24, r.id) for r in reqs]
    policy = resolve_policy(KINDS["affine4-delayed"])
    ref = plain(model, tok, reqs, policy)
    modes = ["right", "wrong", "mixed", "none"]
    draft = ScriptedDraft({r.prompt_ids: (ref[i], modes[i]) for i, r in enumerate(reqs)})
    rounds = []

    def hook(engine):
        step = engine._decode_step

        def checked():
            step()
            for row, off in zip(engine.running, offsets(engine.caches)):
                if not row.out.finish_reason:  # holds every token but the pending one
                    assert off == len(row.request.prompt_ids) + len(row.out.token_ids) - 1
            rounds.append(engine.stats.accepted)

        engine._decode_step = checked

    got, engine = speculative(model, tok, reqs, policy, draft, engine_hook=hook, interleave=False)
    assert got == ref
    h = engine.stats.hist
    assert h[0] > 0 and h[1] > 0 and h[4] > 0  # wrong, mixed and right rows in the same rounds
    first = next(t[1] for t in engine.trace if t[0] == "decode")
    assert len(first) == 4 and len(rounds) == 24 - 1  # every round together; "none" needs 23


def test_conversion_happens_at_the_exact_start(loaded, monkeypatch):
    """Rows crossing quantized-kv-start inside a round convert at exactly the start: only
    accepted tokens count (the verify never reaches the start speculatively)."""
    model, tok, reqs = loaded("llama")
    seen = []
    orig = CompressedKVCache.convert

    def spy(self):
        if not self.converted and self._dims is not None:
            seen.append((self.offset, self.start))
        orig(self)

    monkeypatch.setattr(CompressedKVCache, "convert", spy)
    for start in (13, 20):
        policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=start))
        ref = plain(model, tok, reqs, policy)
        seen.clear()
        assert speculative(model, tok, reqs, policy, ModelDraft(model, policy), k=6)[0] == ref
        assert seen and all(off == s for off, s in seen)
        seen.clear()
        assert speculative(model, tok, reqs, policy, RandomDraft(), k=6)[0] == ref
        assert seen and all(off == s for off, s in seen)


def test_a_row_finishes_mid_round(loaded):
    """EOS and a stop string inside the accepted tokens end the row there."""
    model, tok, reqs = loaded("qwen3")
    policy = resolve_policy(KINDS["full"])
    req = Request(reqs[0].prompt_ids, 30, "x")
    ref = plain(model, tok, [req], policy)[0]
    eos = ref[6]
    stop_at = ref.index(eos)

    def set_eos(engine):
        engine.eos = {eos}

    got, engine = speculative(model, tok, [req], policy, ModelDraft(model, policy), engine_hook=set_eos)
    assert got == [ref[:stop_at]] and engine.done["x"].finish_reason == "eos"
    text = tok.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    req = Request(reqs[0].prompt_ids, 30, "s", (stop,))
    cfg = GenerateConfig(prefill_chunk=CHUNK)
    with attention_context(model):
        want = generate_one(model, tok, req, build_caches(model, policy)[0], cfg)
    _, engine = speculative(model, tok, [req], policy, ModelDraft(model, policy))
    c = engine.done["s"]
    assert (c.finish_reason, c.text, c.token_ids) == ("stop", want.text, want.token_ids)


def test_long_window_rollback_past_dropped_tokens(default_model_dir, loaded):
    """stories260K with a 12-token window for 150 tokens: old tokens are dropped (TRIM_STEP)
    while the row keeps rolling back. The draft (tiny llama, same tokenizer) is mostly
    wrong, so its caches roll back after single-token updates: that needs the spare slots."""
    model, tok = load(str(default_model_dir))
    reqs = [Request(tuple(tok.encode(PROMPTS[1])), 150, "0")]
    policy = resolve_policy(KVOptions(max_kv_size=12, keep=2))
    ref = plain(model, tok, reqs, policy)
    got, engine = speculative(model, tok, reqs, policy, ModelDraft(loaded("llama")[0], policy), k=5)
    assert got == ref and engine.stats.accepted < engine.stats.drafted / 2


def test_sampling_with_the_target_as_draft_accepts_everything(loaded):
    """temp > 0: draft and target distributions agree, so min(1, q/p) = 1 for every draft."""
    from kvcore.engine import SamplingConfig

    model, tok, reqs = loaded("llama")
    policy = resolve_policy(KINDS["affine8"])
    sampling = SamplingConfig(temp=0.8, top_p=0.9, seed=3)
    engine = SpecEngine(model, tok, policy, ModelDraft(model, policy, sampling), 4, 4,
                        GenerateConfig(sampling, CHUNK))
    with attention_context(model):
        out = engine.run(reqs)
    assert [len(c.token_ids) for c in out] == [r.max_tokens for r in reqs]
    assert engine.stats.accepted >= 0.97 * engine.stats.drafted > 0
    engine = SpecEngine(model, tok, policy, PromptLookup(), 4, 4, GenerateConfig(sampling, CHUNK))
    with attention_context(model):
        assert [len(c.token_ids) for c in engine.run(reqs)] == [r.max_tokens for r in reqs]


# --- CLI ---------------------------------------------------------------------------------
def _cli(args):
    from typer.testing import CliRunner

    from mlxkv_cli.main import build_app

    return CliRunner().invoke(build_app(), ["generate", *args])


def test_cli_speculative_json_and_stats(tmp_path, default_model_dir):
    r = _cli(["Once upon a time", "-n", "24", "--draft-model", str(default_model_dir), "--kv-bits", "4",
              "--quantized-kv-start", "0", "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    plain_run = _cli(["Once upon a time", "-n", "24", "--kv-bits", "4", "--quantized-kv-start", "0", "--json"])
    want = [json.loads(x) for x in plain_run.stdout.splitlines()][0]["token_ids"]
    assert lines[0]["token_ids"] == want
    s = lines[-1]["speculative"]
    assert s["draft"] == "model" and s["acceptance_rate"] == 1.0 and s["num_draft_tokens"] == 4
    for key in ("mean_accepted", "accepted_histogram", "drafted_tokens", "verified_tokens", "tokens_per_step"):
        assert key in s
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Once upon a time", "id": "a"}\n{"prompt": "Tom and Tom and Tom", "id": "b"}\n')
    r = _cli(["--prompts-file", str(rows), "-n", "12", "--draft", "prompt-lookup", "--num-draft-tokens", "6",
              "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    assert "── a" in r.stdout and "speculative (prompt-lookup, 6 a round)" in r.stderr


def test_cli_draft_with_another_tokenizer_is_one_line_error(tmp_path, tiny_models):
    other = tmp_path / "other"
    shutil.copytree(tiny_models("llama"), other)
    (other / "tokenizer.model").unlink()
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    r = _cli(["Once upon a time", "-n", "4", "--draft-model", str(other)])
    assert r.exit_code == 1 and not r.stdout
    assert r.stderr.count("\n") == 1 and "different tokenizer" in r.stderr
    r = _cli(["Once upon a time", "--draft", "model"])
    assert r.exit_code == 1 and "--draft-model" in r.stderr
