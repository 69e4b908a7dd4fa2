"""Teacher-forced fidelity runs through the same prefill path: per-chunk statistics == statistics
of the whole run's log-probabilities, whatever the chunk; the default chunk comes from memory."""

import numpy as np
import pytest
from mlx_lm import load

from kvcore.codecs import CodecSpec
from kvcore.fidelity import (
    teacher_forced_chunk,
    teacher_forced_logprobs,
    teacher_forced_stats,
    token_stats,
)
from kvcore.policy import KVPolicy, build_caches


@pytest.fixture(scope="module")
def stories(default_model_dir):
    model, tok = load(str(default_model_dir))
    text = "Once upon a time there was a little girl. She liked to play with her big red ball in the park. " * 12
    return model, tok.encode(text)[:300]


@pytest.mark.parametrize("spec,start", [(CodecSpec("affine", 4, 64), 0), (CodecSpec("turbo", 3), 100)])
def test_chunked_stats_equal_stats_of_the_whole_run(stories, spec, start):
    model, tokens = stories
    ref = teacher_forced_logprobs(model, tokens, build_caches(model, KVPolicy())[0], 64)
    policy = KVPolicy(codec=spec, start=start)
    whole = token_stats(ref, teacher_forced_logprobs(model, tokens, build_caches(model, policy)[0], 64), tokens)
    for chunk in (64, 300):
        s = teacher_forced_stats(model, tokens, build_caches(model, policy)[0], ref, chunk)
        assert len(s.kl) == len(tokens) - 1
        for f in ("kl", "agree", "nll_ref", "nll"):
            assert np.allclose(getattr(s, f), getattr(whole, f), atol=1e-4), (chunk, f)


def test_default_chunk_fits_the_budget(stories):
    model, _ = stories
    from kvcore.engine.memory import model_bytes

    config = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 512}
    assert teacher_forced_chunk(model, config, 4096) == 2048  # this machine has room for mlx-lm's chunk
    tight = teacher_forced_chunk(model, config, 4096, budget=model_bytes(model) + 8 * 2**20)
    assert 64 <= tight < 2048  # 8 MB beside weights and KV: a smaller chunk, its logits included
