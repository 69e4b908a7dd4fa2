"""The staged tensor-core form's shared-memory ring (kvcore/attention/cuda_stage.py) on CPU: row
strides free of bank conflicts for the body's fragment reads, the ring within its budget, and the
stage offsets the kernel is compiled with."""

from __future__ import annotations

import pytest

from kvcore.attention import cuda_stage
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.attention.cuda_mma import mma_fits


def test_wavefronts_count_conflicts():
    same_bank = [32 * lane for lane in range(32)]  # every lane a different word of bank 0
    assert cuda_stage.bank_wavefronts(same_bank, 1) == 32
    assert cuda_stage.bank_wavefronts(list(range(32)), 1) == 1
    assert cuda_stage.bank_wavefronts([0] * 32, 1) == 1  # one word: a broadcast
    assert cuda_stage.bank_wavefronts([4 * lane for lane in range(32)], 4) == 4  # LDS.128: 4 phases of 8 lanes


@pytest.mark.parametrize("bits,dim,group", [(2, 128, 64), (4, 64, 64), (4, 128, 32), (4, 128, 64), (4, 256, 64),
                                            (8, 64, 64), (8, 128, 64), (8, 128, 128)])
def test_strides_are_free_of_conflicts_and_rings_fit(bits, dim, group):
    side = Side("affine", bits, group, dim)
    assert mma_fits(side, side, 4, 1, "bfloat16")
    plan = Plan(side, side, 4, 1, mma=2)
    st = plan.stages
    for lanes, width in cuda_stage.key_reads(st.krs, side.words // 4) + cuda_stage.value_reads(st.vrs, side.words // 8):
        assert cuda_stage.bank_wavefronts(lanes, width) == len(lanes) * width // 32
    assert st.krs % 4 == 0 and st.vrs % 4 == 0 and st.krs >= side.words and st.vrs >= side.words
    assert 2 <= st.count <= 4 and plan.smem == 4 * st.count * st.stage <= cuda_stage.STAGE_SMEM
    off = st.offsets(side.groups, side.groups)
    assert off["V"] == 16 * st.krs * 4 and all(o % 16 == 0 for o in off.values())
    assert off["VZ"] + 16 * side.groups * 2 <= st.stage


def test_an_unpadded_value_row_would_conflict():
    """Negative control: 64-byte V rows (4-bit, 128 dims) put lanes c and c + 1 on one bank."""
    lanes, width = cuda_stage.value_reads(16, 2)[0]
    assert cuda_stage.bank_wavefronts(lanes, width) > len(lanes) * width // 32


def _staged_tiles(t_begin: int, t_end: int, warps: int = 4) -> dict[int, list[int]]:
    """The staged loop's tiles per warp, with the kernel text's formulas (tstart, n_it, t0)."""
    out = {}
    for warp in range(warps):
        tstart = t_begin // 16 * 16 + 16 * warp
        n_it = (t_end - tstart + 16 * warps - 1) // (16 * warps) if tstart < t_end else 0
        out[warp] = [tstart + it * 16 * warps for it in range(n_it)]
    return out


@pytest.mark.parametrize("t_begin,t_end", [(0, 1), (0, 64), (0, 65), (37, 300), (64, 128), (500, 517), (15, 16)])
def test_the_staged_loop_visits_each_token_once(t_begin, t_end):
    """Every token of [t_begin, t_end) falls in exactly one warp's tile; tiles start on 16-token edges (the
    tokens below t_begin a rounded start adds are below lo0, which the mask drops) and none starts past t_end."""
    tiles = _staged_tiles(t_begin, t_end)
    seen = [t for starts in tiles.values() for t0 in starts for t in range(t0, t0 + 16) if t_begin <= t < t_end]
    assert sorted(seen) == list(range(t_begin, t_end))
    assert all(t0 % 16 == 0 and t0 < t_end and t0 + 16 > t_begin for s in tiles.values() for t0 in s)


def test_the_ring_never_refills_a_stage_before_it_is_read():
    """Tile it + STG - 1 is issued into the stage tile it - 1 used, after that iteration's closing __syncwarp;
    cp.async.wait_group STG - 1 leaves tile `it` complete (groups commit in order, one per tile)."""
    for count in (2, 3, 4):
        committed = count - 1  # the prologue's groups: tiles 0 .. count - 2
        for it in range(20):
            slot_written = (it + count - 1) % count
            assert slot_written == (it - 1) % count and slot_written != it % count
            committed += 1
            complete = committed - (count - 1)  # what wait_group(count - 1) guarantees
            assert complete >= it + 1


def test_the_ablation_script_edits_apply_to_every_form():
    """scripts/gpu_kernel_ablate.py takes parts out of the kernel text by substitution: each must still
    match the bodies (an edit of a body that breaks one fails here, not on the device)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_kernel_ablate.py"
    spec = importlib.util.spec_from_file_location("gpu_kernel_ablate", path)
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    for variant, forms in ablate.EDITS.items():
        for form in forms:
            full, cut = ablate.ablated_body(form, "full"), ablate.ablated_body(form, variant)
            assert cut != full and len(cut) >= len(full), (variant, form)
