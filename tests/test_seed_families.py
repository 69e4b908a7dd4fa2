"""The seed's families (Gemma 4: windows + KV-shared layers; Qwen3.5: hybrid SSM) under compression.

Random-weight models amplify KV error through their logit scale, so the bounds are each
family's own, measured once (64 tokens teacher-forced in chunks of 8, float32, CPU) and set at
about 2x; each is paired with a negative control (scales doubled) that must fail it.
"""

import json

import pytest

from helpers import PROMPT, ours, per_family
from kvcore.codecs import CodecSpec
from kvcore.fidelity import compare, teacher_forced_logprobs
from kvcore.policy import KVOptions, KVPolicy, build_caches, resolve_policy

# measured: gemma4 8-bit 0.019, 4-bit 2.33; qwen3_5 8-bit 0.00034, 4-bit 0.35 (group 32)
BOUNDS = {("gemma4", 8): 0.04, ("gemma4", 4): 4.5, ("qwen3_5", 8): 0.0008, ("qwen3_5", 4): 0.7}
KV_CONFIG = {"gemma4": [{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 2, "bits": 8, "group_size": 32}],
             "qwen3_5": [{"layer_idx": 1, "bits": 4, "group_size": 32}, {"layer_idx": 3, "bits": 8, "group_size": 32}]}




@pytest.fixture(scope="module")
def family(tiny_models):
    def prepare(path, model, tok):
        ids = tok.encode(PROMPT * 3)[:64]
        return model, tok, ids, teacher_forced_logprobs(model, ids, build_caches(model, KVPolicy())[0], 8)

    return per_family(tiny_models, prepare)


def kl(model, ids, ref, policy) -> float:
    return compare(ref, teacher_forced_logprobs(model, ids, build_caches(model, policy)[0], 8), ids).mean_kl


@pytest.mark.parametrize("name", ["gemma4", "qwen3_5"])
@pytest.mark.parametrize("bits", [8, 4])
def test_logits_within_bounds_with_negative_control(family, name, bits):
    model, _, ids, ref = family(name)
    bound = BOUNDS[(name, bits)]
    assert kl(model, ids, ref, KVPolicy(CodecSpec("affine", bits, 32), start=0)) <= bound
    assert kl(model, ids, ref, KVPolicy(CodecSpec("affine-doubled", bits, 32), start=0)) > bound


@pytest.mark.parametrize("name", ["gemma4", "qwen3_5"])
def test_kv_config_between_its_layers_bounds(family, name, tmp_path):
    model, tok, ids, ref = family(name)
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(KV_CONFIG[name]))
    policy = resolve_policy(KVOptions(kv_config=str(path)))
    mixed = kl(model, ids, ref, policy)
    assert 0 < mixed <= BOUNDS[(name, 4)]
    toks, stats = ours(model, tok, ids[:12], 20, KVOptions(kv_config=str(path)))
    assert stats.compressed_calls > 0 and len(toks) > 0


@pytest.mark.parametrize("name,opts", [
    ("gemma4", KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)),  # its own 16-token windows
    ("qwen3_5", KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0, max_kv_size=12, keep=2)),
])
def test_generation_past_window_wraps(family, name, opts):
    model, tok, ids, _ = family(name)
    base, stats = ours(model, tok, ids[:10], 70, opts, chunk=512)
    assert stats.compressed_calls > 0 and len(base) >= 48  # > 3 wraps of a 16-token window
    assert ours(model, tok, ids[:10], 70, opts, chunk=3)[0] == base
