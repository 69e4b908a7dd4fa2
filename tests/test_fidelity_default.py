"""KV fidelity on the trained default model (stories260K) over held-out TinyStories text.

Bounds were measured once (2 windows x 512 tokens, chunks of 64, float32, CPU):
8-bit g64 mean KL (max of the two windows) 1.2e-5, 4-bit g64 0.0031. Each bound has a negative
control: the same codec with its scales doubled must fail it.
"""

from pathlib import Path

import pytest
from mlx_lm import load

import helpers  # noqa: F401  (registers the affine-doubled control codec)
from kvcore.codecs.base import CodecSpec
from kvcore.fidelity import compare, teacher_forced_logprobs
from kvcore.policy import KVPolicy, build_caches

CORPUS = Path(__file__).resolve().parents[2] / "shared/assets/corpora/tinystories_val_head.txt"
BOUNDS = {8: 5e-5, 4: 6e-3}




@pytest.fixture(scope="module")
def setup(default_model_dir):
    if not CORPUS.is_file():
        pytest.skip(f"corpus not found: {CORPUS}")
    model, tok = load(str(default_model_dir))
    tokens = tok.encode(CORPUS.read_text()[:20000])
    windows = [tokens[i * 512 : (i + 1) * 512] for i in range(2)]
    refs = [teacher_forced_logprobs(model, w, build_caches(model, KVPolicy())[0]) for w in windows]
    return model, windows, refs


def mean_kl(setup, spec: CodecSpec) -> float:
    model, windows, refs = setup
    kls = []
    for w, ref in zip(windows, refs):
        lp = teacher_forced_logprobs(model, w, build_caches(model, KVPolicy(codec=spec, start=0))[0])
        kls.append(compare(ref, lp, w).mean_kl)
    return max(kls)


@pytest.mark.parametrize("bits", [8, 4])
def test_kl_bound_and_negative_control(setup, bits):
    assert mean_kl(setup, CodecSpec("affine", bits, 64)) <= BOUNDS[bits]
    assert mean_kl(setup, CodecSpec("affine-doubled", bits, 64)) > BOUNDS[bits]


def test_full_precision_scheme_has_zero_kl(setup):
    model, windows, refs = setup
    lp = teacher_forced_logprobs(model, windows[0], build_caches(model, KVPolicy(max_kv_size=1024))[0])
    f = compare(refs[0], lp, windows[0])
    assert f.mean_kl < 1e-9 and f.top1_agreement == 1.0
