"""Engine.run is one batch: a request id reused in a later run gets that run's completion (the
engine kept `done` between runs and returned the old one); one id twice in a run is refused."""

import pytest
from mlx_lm import load

from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, resolve_policy


@pytest.fixture(scope="module")
def engine(default_model_dir):
    model, tok = load(str(default_model_dir))
    return Engine(model, tok, resolve_policy(KVOptions()), 2, GenerateConfig(prefill_chunk=16)), tok


def test_a_reused_id_gets_the_new_runs_completion(engine):
    eng, tok = engine
    first = Request(tuple(tok.encode("Once upon a time")), 6, "x")
    second = Request(tuple(tok.encode("The dog ran to the")), 6, "x")
    fresh = Engine(eng.model, tok, eng.policy, 2, eng.config).run([second])[0]
    a = eng.run([first])[0]
    b = eng.run([second])[0]
    assert a.token_ids != fresh.token_ids  # the two prompts continue differently, so the check can fail
    assert b is not a and b.token_ids == fresh.token_ids and b.prompt_tokens == len(second.prompt_ids)
    assert list(eng.done) == ["x"]  # only this run's completions are kept


def test_one_id_twice_in_a_run_is_refused_before_any_work(engine):
    eng, tok = engine
    ids = tuple(tok.encode("Once upon a time"))
    with pytest.raises(MlxkvError, match="request id 'y' appears twice in one run"):
        eng.run([Request(ids, 4, "y"), Request(ids, 4, "z"), Request(ids, 4, "y")])
    assert not eng.has_work  # nothing was queued
    assert [c.id for c in eng.run([Request(ids, 2, "y"), Request(ids, 2, "z")])] == ["y", "z"]
