"""The engine's decode step never waits for the device but once: the sampled tokens' read-back.

Host synchronisations are counted by wrapping every way MLX hands an array to the host or
forces evaluation: mx.eval / mx.async_eval and array.item / tolist / __int__ / __float__ /
__bool__ / __index__. A steady decode step (no row joining or leaving) may queue the next
step (one async_eval, as mlx-lm's generate_step does) and read this step's tokens once.
"""

from collections import Counter

import mlx.core as mx
import pytest

from helpers import ROW_PROMPTS, per_family
from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.policy import KVOptions, resolve_policy

READBACKS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (model, tok))("llama")


class SyncCounter:
    def __init__(self, monkeypatch):
        self.counts = Counter()
        for name in ("eval", "async_eval"):
            real = getattr(mx, name)
            monkeypatch.setattr(mx, name, self._wrap(name, real))
        for name in READBACKS:
            real = getattr(mx.array, name)
            monkeypatch.setattr(mx.array, name, self._wrap("readback", real))

    def _wrap(self, key, real):
        def counted(*a, **k):
            self.counts[key] += 1
            return real(*a, **k)
        return counted

    def take(self) -> Counter:
        out, self.counts = self.counts, Counter()
        return out


@pytest.mark.parametrize("kv", [KVOptions(), KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
                                KVOptions(kv="turbo:k4v3", quantized_kv_start=0)],
                         ids=["full", "affine4", "turbo"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_steady_decode_step_syncs_once(llama, monkeypatch, kv, rows):
    model, tok = llama
    engine = Engine(model, tok, resolve_policy(kv), rows, GenerateConfig(prefill_chunk=8), interleave=False)
    engine.ignore_eos = True
    for i, p in enumerate(ROW_PROMPTS[:rows]):
        engine.add_request(Request(tuple(tok.encode(p)), 24, str(i)))
    while len(engine.running) < rows or engine.scheduler.admitting is not None:  # prefill every row
        engine.step()
    counter = SyncCounter(monkeypatch)
    steps = []
    for _ in range(12):
        engine.step()
        steps.append(counter.take())
    monkeypatch.undo()
    steady = steps[1:-1]  # the first step queues its successor; the last may see rows leave
    assert steady and all(s["readback"] <= 1 and s["eval"] == 0 and s["async_eval"] <= 1 for s in steady), steady
    assert sum(s["readback"] for s in steady) == len(steady)  # the tokens are really read every step


def test_the_counter_sees_a_sync(monkeypatch):
    """Negative control: a step that reads a length back per layer is caught."""
    counter = SyncCounter(monkeypatch)
    x = mx.array([1, 2, 3])
    int(x.max())
    x.tolist()
    mx.eval(x)
    assert counter.take() == Counter({"readback": 2, "eval": 1})


def test_summary_splits_compressed_and_dense_tokens(llama):
    """4-bit KV at head_dim 16, groups of 64 tokens along tokens: short rows compress nothing, and
    the summary says so instead of calling it converted."""
    from kvcore.engine import kv_summary
    from kvcore.policy import build_caches
    from kvcore.jobs.batch import compression_notes

    model, tok = llama
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0))
    short = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=8))
    reqs = [Request(tuple(tok.encode(p)), 4, str(i)) for i, p in enumerate(ROW_PROMPTS[:2])]
    short.run(reqs)
    assert short.peak_kv["compressed_tokens"] == 0 and short.peak_kv["dense_tokens"] > 0
    assert "nothing was compressed" in compression_notes(policy, reqs, short.peak_kv)[0]
    caches, _ = build_caches(model, policy)
    model(mx.array([list(range(3, 203))]), cache=caches)
    kv = kv_summary(caches)
    layers = sum(1 for c in caches if hasattr(c, "enc"))
    assert kv["compressed_tokens"] == layers * 192 and kv["dense_tokens"] == layers * 8  # 3 blocks of 64
