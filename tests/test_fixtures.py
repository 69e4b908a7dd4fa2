"""Tests of the tiny-model fixtures themselves (tests/fixtures/tiny_models.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from fixtures.tiny_models import (
    CANONICAL_PROMPT,
    CANONICAL_STEPS,
    EOS_TOKEN_ID,
    FAMILIES,
    MIN_MARGIN,
    TOKENIZER_FILES,
    canonical_prompt_ids,
    greedy_margin,
)

STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time" (stories260K)


def _qwen3_5_byte_level() -> bool:
    """Whether this transformers rebuilds qwen3_5's tokenizer as ByteLevel BPE (see the fixtures'
    TOKENIZER_CONFIG_OVERRIDES); versions without qwen3_5 in that list keep the stories tokenizer."""
    try:
        from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS as forced
    except ImportError:
        return False
    return "qwen3_5" in forced


QWEN3_5_BYTE_LEVEL = _qwen3_5_byte_level()

# family -> (number of layers, expected cache kinds in order)
EXPECTED = {
    "llama": (3, [KVCache] * 3),
    "qwen3": (2, [KVCache] * 2),
    "gemma3": (4, [RotatingKVCache, KVCache, RotatingKVCache, KVCache]),
    # 6 layers, the last 3 KV-shared: make_cache() covers only the first 3.
    "gemma4": (6, [RotatingKVCache, RotatingKVCache, KVCache]),
    "qwen3_5": (4, [ArraysCache, KVCache, ArraysCache, KVCache]),
}


def test_families_constant():
    assert FAMILIES == ("llama", "qwen3", "gemma3", "gemma4", "qwen3_5")
    assert set(EXPECTED) == set(FAMILIES)


def test_default_model_dir(default_model_dir):
    assert (default_model_dir / "config.json").is_file()
    assert (default_model_dir / "model.safetensors").is_file()


def test_unknown_family(tiny_models):
    with pytest.raises(ValueError):
        tiny_models("gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model(tiny_models, family):
    path = tiny_models(family)
    assert tiny_models(family) == path  # cached per session
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):
        assert (path / name).is_file(), name
    assert all(v.dtype == mx.float32 for v in mx.load(str(path / "model.safetensors")).values())

    model, tokenizer = load(str(path))
    assert tokenizer.bos_token_id == 1
    assert EOS_TOKEN_ID in tokenizer.eos_token_ids
    assert len(tokenizer._tokenizer) == 512  # no added token outside the vocab

    n_layers, kinds = EXPECTED[family]
    assert len(model.layers) == n_layers
    cache = make_prompt_cache(model)
    # exact types: RotatingKVCache is not a KVCache subclass, but be strict anyway
    assert [type(c) for c in cache] == kinds
    if family == "gemma3":
        assert {c.max_size for c in cache if isinstance(c, RotatingKVCache)} == {16}
    if family == "gemma4":
        assert len(cache) < len(model.layers)

    ids = canonical_prompt_ids(tokenizer)
    assert ids == tokenizer.encode(CANONICAL_PROMPT)
    if family == "qwen3_5" and QWEN3_5_BYTE_LEVEL:
        # transformers forces a ByteLevel Qwen3_5Tokenizer for this model_type.
        assert ids[0] == 1 and len(ids) == 10
    else:
        assert ids == STORIES_PROMPT_IDS
    tokens, margin = greedy_margin(model, ids, CANONICAL_STEPS)
    assert len(tokens) == CANONICAL_STEPS
    assert margin >= MIN_MARGIN
    assert len(set(tokens)) >= 3
    assert EOS_TOKEN_ID not in tokens

    # The recorded build info matches a fresh run.
    info = json.loads((path / "tiny_model.json").read_text())
    assert info["tokens"] == tokens

    # mlx-lm's own greedy generation (different prefill split) agrees.
    gen = [
        int(t)
        for t, _ in generate_step(mx.array(ids), model, max_tokens=CANONICAL_STEPS)
    ]
    assert gen == tokens
