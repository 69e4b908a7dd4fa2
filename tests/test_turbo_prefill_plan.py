"""Turbo's prefill plan on CUDA: its one-launch decode (`turbo_cuda`) holds its output alone, so a 128k
prompt's past fits the attention budget fused, as affine's does. Run 13 planned it with the portable decode's
float32 working arrays (5.1x the scratch), so where the attention budget is a small card's (not an H200's 17 GB)
every layer of turbo's 128k prefill went to the blockwise loop.
The plan is arithmetic and is tested on CPU with the backend told it is CUDA; the measured workspace of the
launch is tested where it runs (CUDA)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

import kvcore.backend as kb
from kvcore.attention.config import DEFAULT as DEFAULT_ATTENTION
from kvcore.attention.scratch import workspace_factor
from kvcore.backend import Verdicts, backend_name
from kvcore.bench.grid import scheme_policy
from kvcore.bench.shapes import SHAPES
from kvcore.codecs import CodecSpec, make_codec, turbo_cuda
from kvcore.transient import plan_prefill

WEIGHTS = 16_060_000_000  # llama-8b's bf16 weights
# the attention budget of a 24 GB CUDA card (1/8 of its working set), pinned: the device default is the
# machine's (an H200's 17 GB holds the portable decode's working arrays too, so the plan there is fused either way)
SCRATCH = 1_580_000_000
T4, T3 = CodecSpec("turbo", 4), CodecSpec("turbo", 3)


def _on_cuda(monkeypatch, verdict: str | None) -> None:
    """Selection told it runs on CUDA, every turbo decode setting's device check answered `verdict`."""
    monkeypatch.setattr(kb, "_backend", lambda cpu: "cuda")
    verdicts = Verdicts("turbo decode")
    for bits in (3, 4):
        for dim in (64, 128):
            for dt in turbo_cuda.DTYPES:
                verdicts[(bits, dim, dt)] = verdict
    monkeypatch.setattr(turbo_cuda, "_VERDICTS", verdicts)


def _plan(scheme: str, context: int = 131072):
    attention = replace(DEFAULT_ATTENTION, scratch_bytes=SCRATCH)
    return plan_prefill(SHAPES["llama-8b"], scheme_policy(scheme), context, WEIGHTS, 0, attention=attention)


def test_turbo_128k_prefill_is_planned_fused_where_its_decode_kernel_serves(monkeypatch):
    _on_cuda(monkeypatch, None)
    assert workspace_factor(make_codec(T4, 128), mx.bfloat16) == workspace_factor(make_codec(CodecSpec("affine", 4, 64), 128), mx.bfloat16)
    turbo, affine = _plan("turbo:k4v3"), _plan("affine:4")
    assert turbo.transient.group == affine.transient.group == 2048  # every layer fused, whole query chunks
    assert turbo.transient.attention.scratch == affine.transient.attention.scratch == 1 << 29  # 128k x 8 heads x 128 x 2 x bf16


def test_turbo_128k_prefill_goes_blockwise_where_its_decode_kernel_is_refused(monkeypatch):
    _on_cuda(monkeypatch, "the turbo decode kernel differs from the portable decode")  # the portable decode serves
    assert workspace_factor(make_codec(T3, 128), mx.bfloat16) == 5.1
    assert _plan("turbo:k4v3").transient.group == 0  # its float32 working arrays do not fit the budget
    assert _plan("turbo:k4v3", 32768).transient.group == 2048  # a shorter past still does


@pytest.mark.skipif(backend_name() != "cuda", reason="the one-launch turbo decode runs on CUDA")
@pytest.mark.parametrize("spec", [T4, T3], ids=["turbo4", "turbo3"])
def test_turbo_decode_launch_holds_its_output_alone(spec):
    codec = make_codec(spec, 128)
    enc = codec.encode(mx.random.normal((1, 8, 8192, 128), key=mx.random.key(1)).astype(mx.bfloat16))
    mx.eval(enc)
    assert turbo_cuda.serves(codec, mx.bfloat16)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = codec.decode_rotated(enc, mx.bfloat16)
    mx.eval(out)
    used = mx.get_peak_memory() - base
    assert used <= out.nbytes * (1 + workspace_factor(codec, mx.bfloat16)), (used, out.nbytes)
