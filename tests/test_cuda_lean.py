"""Form 3's lean loop (kvcore/attention/cuda_lean.py, the default; MLXKV_CUDA_LEAN=0 keeps form 3's text) and its
carried pointers over full tiles (cuda_carry.py, MLXKV_CUDA_LEAN=2): on CPU, that the lean text is form 3's loop
written twice (vector loads, word loads) with only the per-tile overheads changed, and the carried text the lean
loop split at the warp's last tile with only the loads' addresses changed; on CUDA, that each passes the admission
check and gives form 3's outputs bit for bit."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from kvcore.attention import cuda_carry, cuda_form3, cuda_kernels, cuda_lean, cuda_scaled
from kvcore.attention.cuda_check import check_inputs, check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name


def test_the_lean_loop_is_form_3s_loop_twice_with_its_overheads_out():
    text = cuda_lean.lean(cuda_form3.BODY)
    assert text.count(cuda_lean._LOOP_START) == 2 and text.count("constexpr bool VEC =") == 2
    assert ", kvec);" not in text and ", vvec);" not in text and text.count(", VEC);") == 4
    assert text.count("const int pbt = PAGED ? pb_next : b;") == 2 and "const int pbt = pb_next;" not in text
    assert text.count("__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)") == 2
    # undo the rewrites in one copy of the loop: form 3's loop, character for character
    start = text.index(cuda_lean._LOOP_START)
    one = text[start:text.index(cuda_lean.VEC_END)]
    undone = (one.replace("const int pbt = PAGED ? pb_next : b;", "const int pbt = pb_next;")
              .replace("load_words<WTK>(r ? w1 : w0, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, VEC);",
                       "load_words<WTK>(r ? w1 : w0, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, kvec);")
              .replace("+ 4 * WTV * g, VEC);", "+ 4 * WTV * g, vvec);")
              .replace("    if (__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)) {  // a maximum moved\n", "")
              .replace(cuda_lean._RESCALE + "    }\n", cuda_lean._RESCALE))
    body = cuda_form3.BODY
    assert undone == body[body.index(cuda_lean._LOOP_START):body.index(cuda_lean._LOOP_END)]
    assert cuda_lean.lean(cuda_scaled.body()).count("deqs(") == 10  # the scaled variant's loop, twice
    with pytest.raises(AssertionError, match="cuda_lean"):
        cuda_lean.lean(cuda_form3.BODY.replace("const int pbt = pb_next;", ""))


def test_the_carried_loop_is_the_lean_loop_split_at_the_last_tile():
    lean = cuda_lean.lean(cuda_form3.BODY)
    text = cuda_carry.carry(lean)
    a = text.index("  if constexpr (!PAGED) {\n")
    b = text.index(cuda_lean.VEC_END, a)
    split = text[a:b]
    la, lb = lean.index(cuda_lean.VEC_HEAD) + len(cuda_lean.VEC_HEAD), lean.index(cuda_lean.VEC_END)
    loop = lean[la:lb]
    assert text[:a] + text[b:] == lean[:la] + lean[lb:]  # nothing outside the vector loop changed
    full, rest = split.split(cuda_carry.LAST)
    last, paged = (cuda_carry.LAST + rest).split("\n  } else {\n")
    assert paged == loop + "\n  }\n"  # paged rows: the lean loop as it is
    assert last == loop.replace(cuda_carry.FOR, cuda_carry.LAST)  # the last tile: the lean loop's text
    body = full[full.index(cuda_carry.PIECES[0][1]):]
    olds = [p.strip() for old, _ in cuda_carry.PIECES for p in old.split("\n") if p.strip()]
    news = [p.strip() for _, new in cuda_carry.PIECES for p in new.split("\n") if p.strip()]
    kept = lambda text, pieces: [ln for ln in text.rstrip("\n").split("\n") if not any(p in ln for p in pieces)]
    # every other line of the loop is the lean loop's, in its order: only the loads' addresses changed
    assert kept(loop, olds) == kept(body, news) and len(kept(loop, olds)) > 80
    assert "min(t0" not in body and not re.search(r"\b(tp|pb|ksr|kbr|mo|zo)\b", body)  # no clamp, no row base
    assert "(VPL * g) / VG" not in body and "vgrp" not in body  # the value group: in the pointers already
    assert cuda_carry.carry(cuda_lean.lean(cuda_scaled.body())).count("deqs(") == 20  # scaled codes: four loops
    with pytest.raises(AssertionError, match="cuda_carry"):
        cuda_carry.carry(lean.replace("+ tp * vtb + 4 * WTV * g, VEC);", "+ tp * vtb, VEC);"))


def test_where_the_lean_loop_applies(monkeypatch):
    a4 = Side("affine", 4, 64, 128)
    three, one = Plan(a4, a4, 4, 1, False, 3), Plan(a4, a4, 4, 1, False, 1)
    monkeypatch.delenv("MLXKV_CUDA_LEAN", raising=False)
    monkeypatch.delenv("MLXKV_CUDA_DEQ", raising=False)
    assert cuda_kernels._special(three) == ("form3", 1, 0) and cuda_kernels._special(one) == ("", 0, 0)
    assert "constexpr bool VEC = true;" in cuda_kernels.body(3, "form3", 1)
    monkeypatch.setenv("MLXKV_CUDA_LEAN", "0")
    assert cuda_kernels._special(three) == ("form3", 0, 0)
    assert cuda_kernels.body(3, "form3", 0) == cuda_kernels.body(3)  # form 3 as it was
    monkeypatch.setenv("MLXKV_CUDA_LEAN", "2")
    assert cuda_kernels._special(three) == ("form3", 2, 0) and "kp += kadv" in cuda_kernels.body(3, "form3", 2)
    assert "kp += kadv" not in cuda_kernels.body(3, "form3", 1)


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, kg, vb, vg, dim, rep, n, paged", [(4, 64, 4, 64, 128, 4, 1, False),
                                                                (8, 64, 4, 32, 128, 4, 2, False),
                                                                (2, 32, 2, 32, 64, 8, 1, False),
                                                                (4, 64, 8, 64, 256, 2, 3, False),
                                                                (4, 64, 4, 64, 128, 4, 1, True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_lean_loop_is_form_3_bit_for_bit_on_the_device(monkeypatch, kb, kg, vb, vg, dim, rep, n, paged, dtype):
    plan = Plan(Side("affine", kb, kg, dim), Side("affine", vb, vg, dim), rep, n, paged, 3)
    q_dtype = getattr(mx, dtype)
    q, launch, _, sinks, scale, split = check_inputs(plan, q_dtype, seed=3)
    outs = {}
    for on in ("0", "1", "2"):  # form 3, the lean loop, its carried pointers (two rows: full and partial tiles)
        monkeypatch.setenv("MLXKV_CUDA_LEAN", on)
        assert check_plan(plan, q_dtype, seed=1) is None
        outs[on] = cuda_kernels.partials(q, launch, plan, scale, 2, split, sinks=sinks, fused=True)
        mx.eval(outs[on])
    for on in ("1", "2"):
        for a, b in zip(outs["0"], outs[on]):
            assert mx.array_equal(a, b).item(), on
