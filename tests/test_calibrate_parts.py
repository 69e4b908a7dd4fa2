"""calibrate's parts without a model: the knapsack against brute force, the candidate vocabulary,
kv_config's recent field, and the proxy's view of which tokens a query reads encoded."""

import itertools
import json
import random
from pathlib import Path

import mlx.core as mx
import pytest

from kvcore.cache import CompressedKVCache
from kvcore.calibrate.candidates import LayerOption, parse_candidates
from kvcore.calibrate.config_file import config_entries, config_policy, config_text
from kvcore.calibrate.proxy import encoded_visible
from kvcore.calibrate.solve import Item, solve
from kvcore.codecs import CodecSpec
from kvcore.errors import MlxkvError
from kvcore.policy.kv_config import parse_kv_file

# What `optiq kv-cache` (mlx-optiq 0.7.7) wrote for SmolLM2-135M, kept byte for byte (BENCHMARKS.md, calibrate).
OPTIQ_FILE = Path(__file__).resolve().parents[1] / "benchmarks/calibrate-smollm2-optiq-0.7.7-kv_config.json"


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_optimal_and_within_budget(seed):
    rng = random.Random(seed)
    layers = [[Item(rng.random(), rng.randint(10, 400), (n, j)) for j in range(rng.randint(1, 5))] for n in range(5)]
    budget = rng.randint(sum(min(i.nbytes for i in items) for items in layers), 1500)
    got = solve(layers, budget)
    best = min((combo for combo in itertools.product(*layers) if sum(i.nbytes for i in combo) <= budget),
               key=lambda combo: sum(i.cost for i in combo))
    assert sum(i.nbytes for i in got) <= budget  # budget < RESOLUTION: one byte a unit, so the DP is exact
    assert sum(i.cost for i in got) == pytest.approx(sum(i.cost for i in best))


def test_knapsack_refuses_a_budget_below_the_smallest_config():
    with pytest.raises(MlxkvError, match="below the smallest candidate config"):
        solve([[Item(1.0, 100, "a")], [Item(1.0, 100, "b")]], 199)


def test_candidate_vocabulary():
    c = parse_candidates("full,affine:3..5/g32/g64,turbo:2..3,/r16")
    assert c.recents == (0, 16) and c.full and c.split
    assert [f.bits for f in c.families] == [(3, 4, 5), (2, 3)] and c.families[0].groups == (32, 64)
    opts = c.options(16)
    assert opts[0] == LayerOption() and len(opts) == 1 + 2 * 9 + 4
    assert LayerOption(CodecSpec("turbo", 3), CodecSpec("turbo", 2), 16) in opts
    assert parse_candidates("affine:2..8").families[0].bits == (2, 3, 4, 5, 6, 8)  # the widths affine has
    optiq = parse_candidates(None, optiq_compatible=True)
    assert not optiq.split and optiq.recents == (0,)
    assert all(o.key == o.value for o in optiq.options(0))
    for bad, message in (("zip:4", "unknown codec 'zip'"), ("turbo:4/g32", "has no group size"),
                         ("affine:8..4", "empty range"), ("affine:4/r16", "own item"), ("affine", "expected CODEC")):
        with pytest.raises(MlxkvError, match=message):
            parse_candidates(bad)


def test_config_entries_keep_optiqs_format_for_plain_affine():
    choices = {0: LayerOption(CodecSpec("affine", 4, 64), CodecSpec("affine", 4, 64)), 1: LayerOption(),
               2: LayerOption(CodecSpec("affine", 8, 32), CodecSpec("affine", 8, 32))}
    entries = config_entries(choices)
    assert config_text(entries) == ('[\n  {\n    "layer_idx": 0,\n    "bits": 4,\n    "group_size": 64\n  },\n'
                                    '  {\n    "layer_idx": 2,\n    "bits": 8,\n    "group_size": 32\n  }\n]')
    split = config_entries({3: LayerOption(CodecSpec("turbo", 5), CodecSpec("turbo", 3), 16)})
    assert split == [{"layer_idx": 3, "codec": "turbo", "key_bits": 5, "value_bits": 3, "recent": 16}]
    policy = config_policy(split)
    assert policy.codec_for(3) == CodecSpec("turbo", 5) and policy.value_codec_for(3) == CodecSpec("turbo", 3)
    assert policy.recent_for(3) == 16 and policy.codec_for(0) == CodecSpec("full")


def test_optiqs_own_file_is_read_and_written_back_byte_for_byte():
    raw = OPTIQ_FILE.read_text()
    cfg = parse_kv_file(json.loads(raw))
    assert len(cfg.layers) == 30 and cfg.recents == ()
    choices = {i: LayerOption(k, v) for i, k, v in cfg.layers}
    assert config_text(config_entries(choices)) == raw  # optiq's json.dump(indent=2), no trailing newline
    policy = config_policy(config_entries(choices))
    assert [policy.codec_for(i).bits for i in range(30)] == [e["bits"] for e in json.loads(raw)]


def test_kv_config_recent_per_layer(tmp_path):
    assert parse_kv_file([{"layer_idx": 0, "bits": 4}]).recents == ()
    cfg = parse_kv_file([{"layer_idx": 2, "bits": 4, "recent": 8}, {"layer_idx": 1, "bits": 8}])
    assert cfg.recents == ((2, 8),)
    with pytest.raises(MlxkvError, match="recent must be an integer"):
        parse_kv_file(json.loads('[{"layer_idx": 0, "bits": 4, "recent": "16"}]'))
    with pytest.raises(MlxkvError, match="recent -1 is negative"):
        parse_kv_file([{"layer_idx": 0, "bits": 4, "recent": -1}])
    entries = config_entries({0: LayerOption(CodecSpec("turbo", 4), CodecSpec("turbo", 4), 16),
                              1: LayerOption(CodecSpec("turbo", 3), CodecSpec("turbo", 3), 0)})
    policy = config_policy(entries)
    assert (policy.recent_for(0), policy.recent_for(1), policy.recent_for(5)) == (16, 0, 0)


@pytest.mark.parametrize("spec,recent", [(CodecSpec("turbo", 4), 0), (CodecSpec("turbo", 4), 5),
                                         (CodecSpec("affine", 4, 32), 0), (CodecSpec("affine", 4, 32), 3)])
def test_encoded_visibility_matches_the_cache(spec, recent):
    """Which (query, token) pairs the proxy treats as encoded is what a CompressedKVCache serves."""
    T, D = 80, 8  # head_dim 8: affine groups 32 tokens per channel
    x = mx.random.normal((1, 1, T, D))
    c = CompressedKVCache(spec, start=0, recent=recent)
    seen = []
    for t in range(T):  # one token at a time: row t = what query t reads encoded
        view = c.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])[0]
        row = mx.zeros((T,), dtype=mx.bool_)
        for s in view.segments:
            if s.kind == "encoded":
                vis = s.visible(mx.array([t]), 0, s.length, None, 0)[0]
                row[s.start : s.start + s.length] = vis
        seen.append(row)
    want = encoded_visible(mx.arange(T), T, c.block_tokens, recent) & (mx.arange(T)[:, None] >= mx.arange(T)[None])
    assert mx.array_equal(mx.stack(seen), want)
