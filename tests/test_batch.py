"""Batched and continuous generation: every row equals the same prompt generated alone."""

import json

import mlx.core as mx
import pytest

from fixtures.tiny_models import FAMILIES, MIN_MARGIN
from helpers import ROW_PROMPTS as PROMPTS, assert_rows_equal_to_near_ties, margin_under, per_family, tie_free_prefix
from kvcore.attention import attention_context
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import CodecSpec
from kvcore.engine import GenerateConfig, Request, generate_one
from kvcore.engine import Engine
from kvcore.errors import MlxkvError
from kvcore.engine.prompts_file import load_prompts_file
from kvcore.policy import KVOptions, build_caches, resolve_policy

CHUNK = 8


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (
        model, tok, [Request(tuple(tok.encode(p)), 12 + 2 * i, str(i)) for i, p in enumerate(PROMPTS)]))


def alone_and_batched(model, tok, reqs, opts, batch_size):
    policy = resolve_policy(opts)
    cfg = GenerateConfig(prefill_chunk=CHUNK)
    with attention_context(model, required=policy.compresses):
        alone = [generate_one(model, tok, r, build_caches(model, policy)[0], cfg).token_ids for r in reqs]
        engine = Engine(model, tok, policy, batch_size, cfg)
        batched = [c.token_ids for c in engine.run(reqs)]
    return alone, batched, engine


KINDS = {
    "full": KVOptions(),
    "affine8-start0": KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0),
    "affine4": KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0),
    # start 13: the long prompts cross it in prefill, "Tom" and "The dog" only while decoding
    "affine4-delayed": KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=13),
    "window": KVOptions(max_kv_size=10, keep=2),
    "window-affine8": KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0, max_kv_size=10, keep=2),
    "turbo-delayed": KVOptions(kv="turbo:k4v3", quantized_kv_start=13),
    "window-turbo-recent": KVOptions(kv="turbo:k8v4/r3", max_kv_size=10, keep=2),
}


# "affine4" groups 64 tokens where head_dim is 16 or 32 (llama, gemma3, qwen3_5): no row here fills a
# group, so nothing is encoded, as in affine8-start0's rows below 32 tokens on llama (cut as redundant)
NOTHING_ENCODED = {("affine4", "llama"), ("affine4", "gemma3"), ("affine4", "qwen3_5")}


@pytest.mark.parametrize("kind,family", [(k, f) for k in KINDS for f in FAMILIES if (k, f) not in NOTHING_ENCODED])
def test_batched_rows_equal_alone(loaded, family, kind):
    model, tok, reqs = loaded(family)
    alone, batched, engine = alone_and_batched(model, tok, reqs, KINDS[kind], batch_size=4)
    assert_rows_equal_to_near_ties(model, reqs, alone, batched, KINDS[kind])
    assert max(len(t[1]) for t in engine.trace if t[0] == "decode") >= 3  # rows really shared steps


def test_the_near_tie_comparison_still_catches_a_wrong_token(loaded):
    """The rows' comparison stops at a row's first near-tie only: a token changed before it (or a row cut
    short) fails it, and so does a run where too few tokens come before the ties."""
    model, tok, reqs = loaded("gemma3")
    opts = KINDS["affine8-start0"]
    alone, _, _ = alone_and_batched(model, tok, reqs, opts, batch_size=1)
    wrong = [list(a) for a in alone]
    wrong[0][0] = (wrong[0][0] + 1) % 400  # row 0's first margin is 21.7: no tie before it
    with pytest.raises(AssertionError, match="row 0"):
        assert_rows_equal_to_near_ties(model, reqs, alone, wrong, opts)
    with pytest.raises(AssertionError):
        assert_rows_equal_to_near_ties(model, reqs, alone, [a[:1] for a in alone], opts)
    ties = [tie_free_prefix(model, r.prompt_ids, a, opts, 1e-2) for r, a in zip(reqs, alone)]
    row = next((i for i, (n, a) in enumerate(zip(ties, alone)) if n < len(a)), None)  # row 3 at 14 here (0.004)
    if row is not None:
        late = [list(a) for a in alone]
        late[row][-1] = (late[row][-1] + 1) % 400  # past the row's tie: not compared, though the rest is
        assert_rows_equal_to_near_ties(model, reqs, alone, late, opts)
        with pytest.raises(AssertionError):  # ... unless the compared share must be all of it
            assert_rows_equal_to_near_ties(model, reqs, alone, late, opts, compared=1.0)


def test_margins_of_the_compared_runs(loaded):
    model, tok, reqs = loaded("llama")
    for opts in (KINDS["affine4-delayed"], KINDS["window-affine8"]):
        policy = resolve_policy(opts)
        with attention_context(model):
            for r in reqs:
                toks = generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids
                assert margin_under(model, r.prompt_ids, toks, opts) >= MIN_MARGIN


def test_rows_cross_the_start_at_their_own_position(loaded):
    model, tok, reqs = loaded("llama")
    policy = resolve_policy(KINDS["affine4-delayed"])
    engine = Engine(model, tok, policy, 4, GenerateConfig(prefill_chunk=CHUNK))
    seen = {}
    orig = engine._decode_step

    def spy():
        if engine.caches is not None and engine.running:
            c = engine.caches[0]
            rows = c.rows if isinstance(c, BatchCompressedKVCache) else [c]  # a lone row keeps its own caches
            seen.setdefault("mixed", False)
            conv = [r.converted for r in rows]
            if any(conv) and not all(conv):
                seen["mixed"] = True
                for r in rows:  # row-local: converted right before its own query at position 13
                    assert r.converted == (r.offset > 13)
                    assert r.pending_conversion == (r.offset == 13)
        orig()

    engine._decode_step = spy
    with attention_context(model):
        engine.run(reqs)
    assert seen["mixed"]


def test_continuous_batching_joins_and_leaves(loaded):
    """batch size 2 with 4 rows: rows join mid-decode and leave when done; same tokens."""
    model, tok, reqs = loaded("gemma3")
    alone, batched, engine = alone_and_batched(model, tok, reqs, KINDS["affine8-start0"], batch_size=2)
    assert_rows_equal_to_near_ties(model, reqs, alone, batched, KINDS["affine8-start0"])
    decodes = [t[1] for t in engine.trace if t[0] == "decode"]
    assert max(len(d) for d in decodes) == 2
    assert any(set(a) != set(b) for a, b in zip(decodes, decodes[1:]))  # membership changed
    # at most one prefill chunk between two decode steps once decoding has begun
    first = next(i for i, t in enumerate(engine.trace) if t[0] == "decode")
    run = 0
    for t in engine.trace[first:]:
        run = run + 1 if t[0] == "prefill" else 0
        assert run <= 1
        assert t[0] != "prefill" or t[2] <= CHUNK


def test_batch_protocol_round_trips_exactly():
    mx.random.seed(0)
    rows = []
    for n in (5, 40, 70):
        c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, window=48, keep=2)
        c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
        rows.append(c)
    before = [tuple(mx.array(a) for a in r.state) for r in rows]
    batch = CompressedKVCache.merge(rows[:2])
    batch.extend(BatchCompressedKVCache.merge([rows[2]]))
    assert [int(o) for o in batch.offset.tolist()] == [5, 40, 70]
    batch.filter(mx.array([2, 0]))
    assert batch.extract(0) is rows[2] and batch.extract(1) is rows[0]
    for r, b in zip(rows, before):
        assert all(mx.array_equal(x, y) for x, y in zip(r.state, b))
    assert batch.trim_rows([3, 1]) == [3, 1]
    assert [int(o) for o in batch.offset.tolist()] == [67, 4]


def test_left_padded_prefill_drops_padding(loaded):
    """mlx-lm style left-padded input: the padding columns are never stored."""
    model, tok, reqs = loaded("llama")
    policy = resolve_policy(KINDS["affine4"])
    a, b = list(reqs[0].prompt_ids), list(reqs[3].prompt_ids)
    pad = len(a) - len(b)
    caches = [BatchCompressedKVCache([r]) for r in build_caches(model, policy)[0]]
    for c, c2 in zip(caches, build_caches(model, policy)[0]):
        c.extend(BatchCompressedKVCache([c2]))
        c.prepare(left_padding=[0, pad])
    with attention_context(model):
        logits = model(mx.array([a, [0] * pad + b]), cache=caches)
        for c in caches:
            c.finalize()
        alone_caches = build_caches(model, policy)[0]
        ref = model(mx.array([b]), cache=alone_caches)
    assert caches[0].rows[1].offset == len(b)
    assert mx.allclose(logits[1, -1], ref[0, -1], atol=1e-4).item()


@pytest.mark.parametrize("text,message", [
    ('{"prompt": "a"}\n{bad json\n', "line 2: not valid JSON"),
    ('{"max_tokens": 3}\n', "line 1: missing or empty \"prompt\""),
    ('{"prompt": "a", "max_tokens": -2}\n', "line 1: max_tokens must be a non-negative integer"),
    ('{"prompt": "a", "max_tokens": "5"}\n', "line 1: max_tokens must be a non-negative integer"),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": "1"}\n', "appears more than once"),
    ('{"prompt": "a", "colour": 1}\n', "unknown key 'colour'"),
    ("\n\n", "has no prompts"),
])
def test_malformed_prompts_file(tmp_path, text, message):
    p = tmp_path / "prompts.jsonl"
    p.write_text(text)
    with pytest.raises(MlxkvError, match=message):
        load_prompts_file(p)


def test_plain_text_prompts_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("first prompt\n\nsecond prompt\n")
    specs = load_prompts_file(p)
    # ids by position among the prompts from 0, as -p rows (blank lines skipped)
    assert [(s.prompt, s.id) for s in specs] == [("first prompt", "0"), ("second prompt", "1")]


def test_cli_prompts_file_json(tmp_path):
    from typer.testing import CliRunner

    from mlxkv_cli.main import build_app

    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "Once upon a time", "max_tokens": 12, "id": "a"}\n{"prompt": "The dog", "id": "b"}\n')
    r = CliRunner().invoke(build_app(), ["generate", "--prompts-file", str(p), "-n", "6", "--kv-bits", "8",
                                         "--quantized-kv-start", "0", "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    rows = {x["id"]: x for x in lines if x["type"] == "completion"}
    assert rows["a"]["generated_tokens"] == 12 and rows["b"]["generated_tokens"] == 6
    s = lines[-1]
    assert s["type"] == "summary" and s["rows"] == 2 and s["generated_tokens"] == 18
    assert s["kv_bytes"] > 0 and s["aggregate_tps"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    r = CliRunner().invoke(build_app(), ["generate", "--prompts-file", str(bad)])
    assert r.exit_code == 1 and "line 2" in r.stderr and not r.stdout


def test_packed_rows_serve_the_batch_and_unpack_exactly():
    """Per-token, converted, full-attention rows are packed; the results equal row-by-row."""
    from kvcore.attention import attention_context  # noqa: F401  (hook dispatch covered elsewhere)
    from kvcore.attention.blockwise import batch_kv_attention, packed_attention

    mx.random.seed(7)

    def rows():
        out = []
        for n in (3, 17, 40):
            c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
            c.update_and_fetch(mx.random.normal((1, 2, n, 64), key=mx.random.key(n)),
                               mx.random.normal((1, 2, n, 64), key=mx.random.key(n + 1)))
            out.append(c)
        return out

    packed, plain = BatchCompressedKVCache(rows()), BatchCompressedKVCache(rows())
    k, v = mx.random.normal((3, 2, 2, 64)), mx.random.normal((3, 2, 2, 64))
    q = mx.random.normal((3, 4, 2, 64))
    pv, _ = packed.update_and_fetch(k, v)
    assert packed.packed is not None and not packed.live_rows
    plain._maybe_pack = lambda: None  # force the row-by-row path for the reference
    rv, _ = plain.update_and_fetch(k, v)
    assert mx.allclose(packed_attention(q, pv, 0.125), batch_kv_attention(q, rv, 0.125), atol=1e-5).item()
    assert packed.nbytes == plain.nbytes and packed.elements == plain.elements
    assert [int(x) for x in packed.offset.tolist()] == [5, 19, 42]
    assert packed.trim_rows([1, 0, 3]) == [1, 0, 3]
    packed.filter([2, 0])
    back = packed.rows  # unpack
    assert packed.packed is None and [r.offset for r in back] == [39, 4]
    ref = plain.rows
    ref[2].trim(3)
    ref[0].trim(1)
    for got, want in ((back[0], ref[2]), (back[1], ref[0])):
        assert all(mx.array_equal(a, b) for a, b in zip(got.state, want.state))


def test_engine_decodes_packed_rows(loaded):
    model, tok, reqs = loaded("qwen3")  # head_dim 64: per-token affine layout, packable
    opts = KINDS["affine8-start0"]
    policy = resolve_policy(opts)
    engine = Engine(model, tok, policy, 4, GenerateConfig(prefill_chunk=CHUNK))
    seen = []
    orig = engine._decode_step

    def spy(*a, **k):
        orig(*a, **k)
        if engine.caches is not None:
            seen.append(getattr(engine.caches[0], "packed", None) is not None)  # a lone row: its own cache

    engine._decode_step = spy
    with attention_context(model):
        batched = [c.token_ids for c in engine.run(reqs)]
    alone, _, _ = alone_and_batched(model, tok, reqs, opts, batch_size=1)
    assert any(seen) and batched == alone
