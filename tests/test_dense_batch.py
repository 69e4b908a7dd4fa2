"""Full-precision batch rows of one length decode with no mask (the fused kernel's case) and
give the same tokens as each row alone; a row of another length brings the mask back."""

import pytest

from helpers import per_family
from kvcore.cache.dense_batch import DenseBatchKVCache
from kvcore.engine import Engine, GenerateConfig, Request, generate_one
from kvcore.policy import KVOptions, build_caches, resolve_policy


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (model, tok))("llama")


def test_equal_rows_need_no_mask_and_match_alone(llama):
    model, tok = llama
    policy = resolve_policy(KVOptions())
    reqs = [Request(tuple(3 + (7 * i + j) % 200 for j in range(12)), 10, str(i)) for i in range(3)]
    reqs.append(Request(tuple(range(3, 20)), 6, "long"))  # joins later: its own length
    alone = [generate_one(model, tok, r, build_caches(model, policy)[0]).token_ids for r in reqs]
    out, seen, _ = run_watching(model, tok, policy, 4, reqs)
    assert [c.token_ids for c in out] == alone
    assert (4, True) in seen  # rows of different lengths: the array mask
    out, seen, _ = run_watching(model, tok, policy, 3, reqs[:3])
    assert [c.token_ids for c in out] == alone[:3]
    assert (3, False) in seen  # one length: no mask at all


def run_watching(model, tok, policy, batch, reqs):
    """(completions, {(running rows, padded)} seen at each decode step of a full-precision batch, the engine)."""
    engine = Engine(model, tok, policy, batch, GenerateConfig(prefill_chunk=8), interleave=False)
    seen = set()
    step = engine._decode_step

    def spy():
        c = engine.caches[0]
        if isinstance(c, DenseBatchKVCache):
            seen.add((len(engine.running), c.padded))
        return step()

    engine._decode_step = spy
    return engine.run(reqs), seen, engine
