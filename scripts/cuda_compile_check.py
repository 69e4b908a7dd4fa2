#!/usr/bin/env python3
"""Build the decode kernel's CUDA text on a machine without a GPU: NVRTC for sm_90a, then ptxas's
registers and spills and the SASS instruction count, per tensor-core form (0 scalar, 1, 2, 3) and bit width.

The kernel's own launch code runs (`cuda_kernels.partials` on random 4-bit K/V), with
`mx.fast.cuda_kernel` replaced by a stand-in that writes the text MLX would compile (MLX's header is
stood in for by the two types the kernel uses: `Shape` and `Strides`) and compiles it. A CUDA error,
a spill, or a register count that costs a block per SM shows here before any device minute is spent.
Needs NVRTC and nvdisasm from PyPI (no GPU, no CUDA install):

    pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm nvidia-cuda-runtime
    python scripts/cuda_compile_check.py [--forms 0,1,2,3] [--bits 4,8] [--paged] [--sass out_folder]
                                         [--turbo 4,3 [--q-dtype float32]]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx

_CT = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
       mx.int32: "int32_t", mx.uint8: "uint8_t", mx.int64: "int64_t", mx.bool_: "bool", mx.uint16: "uint16_t"}
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/", re.M)  # one per instruction in nvdisasm's listing
PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned int uint32_t; typedef int int32_t; typedef unsigned char uint8_t; typedef unsigned short uint16_t;
typedef long long int64_t; typedef unsigned long long uint64_t;
#define inf __int_as_float(0x7f800000)
struct Shape { int32_t v[8]; __device__ const int32_t* data() const { return v; }
               __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[8]; __device__ const int64_t* data() const { return v; }
                 __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def _nvidia_root() -> Path:
    try:
        import nvidia.cu13 as cu  # the CUDA 13 wheels' namespace
    except ImportError:
        raise SystemExit("error: NVRTC missing: pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm nvidia-cuda-runtime")
    return Path(list(cu.__path__)[0])


class Compiler:
    def __init__(self):
        root = _nvidia_root()
        lib = next(iter(sorted((root / "lib").glob("libnvrtc.so*"))), None)
        if lib is None:
            raise SystemExit(f"error: no libnvrtc.so under {root / 'lib'}: pip install nvidia-cuda-nvrtc")
        self.nv = ctypes.CDLL(str(lib))
        self.include = root / "include"
        self.nvdisasm = root / "bin" / "nvdisasm"

    def compile(self, name: str, text: str) -> tuple[bytes, str]:
        nv, prog = self.nv, ctypes.c_void_p()
        nv.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{name}.cu".encode(), 0, None, None)
        opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", b"-default-device", b"--ptxas-options=-v",
                f"-I{self.include}".encode()]
        rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"{name}: NVRTC failed\n{log.value.decode(errors='replace')[-4000:]}")
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, log.value.decode(errors="replace")

    def sass(self, cubin: bytes, where: Path) -> str:
        where.write_bytes(cubin)
        if not self.nvdisasm.exists():
            return ""
        return subprocess.run([str(self.nvdisasm), "-c", str(where)], capture_output=True, text=True).stdout


def hot_loop(sass: str) -> tuple[int, list]:
    """The innermost loop that runs the tensor cores (a backward branch around HMMA): its instruction count
    and its 10 most frequent opcodes; (0, []) without one (the scalar body)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]
    labels = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"^\.L_x_(\d+):\s*\n\s+/\*([0-9a-f]{4,})\*/", sass, re.M)}
    best = None
    for a, t in ins:
        lab = re.search(r"BRA\s.*\.L_x_(\d+)", t)
        start = labels.get(lab.group(1)) if lab else None
        if start is not None and start < a:
            body = [x for b, x in ins if start <= b <= a]
            if any("HMMA" in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return 0, []
    ops = Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0] for x in best)
    return len(best), ops.most_common(10)


class StandIn:
    """What `mx.fast.cuda_kernel` returns here: on call, the text MLX would build, compiled; zeros out."""
    built: list = []

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 shared_memory=0, **_):
        self.name, self.inputs, self.outputs, self.source, self.header = name, input_names, output_names, source, header

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **_):
        params = []
        for n, a in zip(self.inputs, inputs):
            params.append(f"const {_CT[a.dtype]}* {n}")
            for suffix, t in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if f"{n}_{suffix}" in self.source:
                    params.append(f"const __grid_constant__ {t} {n}_{suffix}")
        params += [f"{_CT[d]}* {n}" for n, d in zip(self.outputs, output_dtypes)]
        consts = ""
        for k, v in template or []:
            if isinstance(v, mx.Dtype):
                consts += f"typedef {_CT[v]} {k};\n"
            else:
                consts += f"constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
        text = (PRELUDE + self.header + f"\n__global__ void {self.name}({', '.join(params)}) {{\n{consts}"
                + self.source + "\n}\n")
        StandIn.built.append((self.name, text, grid, threadgroup))
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


def compiled(cc: Compiler, name: str, text: str, label: str) -> tuple[bytes, str] | None:
    """(cubin, "R registers, S bytes spilled") of one built kernel, or None where NVRTC refuses it (said)."""
    try:
        cubin, log = cc.compile(name, text)
    except RuntimeError as e:
        print(f"{label}: {e}")
        return None
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return cubin, f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled"


def turbo_encode(cc: Compiler, dims: list[int], bits_list: list[int]) -> int:
    """Build and compile the turbo encode launch per (bits, dim, input dtype); 1 if one fails."""
    from kvcore.codecs import CodecSpec, turbo_cuda_encode
    from kvcore.codecs.turbo import TurboCodec

    failed = 0
    for dim in dims:
        for bits in bits_list:
            codec = TurboCodec(CodecSpec("turbo", bits), dim)
            for dtype in turbo_cuda_encode.DTYPES:
                StandIn.built.clear()
                turbo_cuda_encode._KERNELS.clear()
                turbo_cuda_encode.launch(mx.zeros((1, 8, 3, dim), dtype=dtype), codec)
                label = f"turbo encode {bits} bits d {dim} {str(dtype).rsplit('.', 1)[-1]}"
                for name, text, grid, block in StandIn.built:
                    built = compiled(cc, name, text, label)
                    failed += built is None
                    if built is not None:
                        print(f"{label}: {built[1]}, grid {grid}, block {block}", flush=True)
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default="0,1,2,3")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--sass", default=None, help="a folder for each kernel's cubin and SASS text")
    ap.add_argument("--q-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the query's dtype (float32 with --turbo: a steady step's rotated query, as it is)")
    ap.add_argument("--paged", action="store_true", help="the paged rows' kernel (pages found through a block table)")
    ap.add_argument("--turbo", default=None, metavar="KB,VB",
                    help="turbo K/V of these bits instead of affine (with MLXKV_CUDA_TURBO_MMA=1: the tensor-core body)")
    ap.add_argument("--rotate", action="store_true",
                    help="with --turbo: the launch rotates the query and its output itself (cuda_rotate.py)")
    ap.add_argument("--turbo-encode", default=None, metavar="DIMS",
                    help="instead: TurboQuant's one-launch encode (kvcore/codecs/turbo_cuda_encode.py) for these head "
                         "dims (e.g. 64,128) and --bits, each input dtype")
    a = ap.parse_args()
    cc = Compiler()
    mx.fast.cuda_kernel = StandIn  # before the kernel modules build anything
    if a.turbo_encode:
        sys.exit(turbo_encode(cc, [int(d) for d in a.turbo_encode.split(",")], [int(b) for b in a.bits.split(",")]))
    from kvcore.attention import cuda_kernels as ck
    from kvcore.attention.cuda_launch import BIG, PAGE, Plan, Side
    from kvcore.codecs import CodecSpec
    from kvcore.attention.cuda_mma import mma_fits
    from kvcore.codecs.affine import AffineCodec
    from kvcore.codecs.turbo import TurboCodec

    HQ, HKV, D, T = 32, 8, 128, 512
    failed = 0
    for form in (int(f) for f in a.forms.split(",")):
        for bits in (int(b) for b in a.bits.split(",")):
            side, codec = Side("affine", bits, 64, D), AffineCodec(CodecSpec("affine", bits, 64), D)
            vside, vcodec, books = side, codec, (ck.dummy(mx.float32), ck.dummy(mx.float32))
            if a.turbo:
                kb_, vb_ = (int(x) for x in a.turbo.split(","))
                codec, vcodec = TurboCodec(CodecSpec("turbo", kb_), D), TurboCodec(CodecSpec("turbo", vb_), D)
                side, vside = Side("turbo", kb_, D, D), Side("turbo", vb_, D, D)
                books = (codec.centroids, vcodec.centroids)
            plan = Plan(side, vside, HQ // HKV, 1, a.paged, form if mma_fits(side, vside, HQ // HKV, 1, a.q_dtype) else 0,
                        rotate=bool(a.turbo and a.rotate))
            if plan.rotate:  # its key book followed by the rotation's signs
                from kvcore.attention.cuda_rotate import book_with_signs

                books = (book_with_signs(books[0], codec.rotation.signs), books[1])
            label = f"turbo:{a.turbo}" if a.turbo else f"affine:{bits}"
            if plan.why_not():
                print(f"form {form} {label}: not covered ({plan.why_not()})")
                continue
            pages = T // PAGE
            shape = (pages, HKV, PAGE, D) if a.paged else (1, HKV, T, D)  # pages (P, H', PAGE, ...) or one row
            parts = [c.encode(mx.random.normal(shape)) for c in (codec, vcodec)]
            parts = [p if len(p) == 3 else (*p, ck.dummy()) for p in parts]  # turbo: (packed, norm) + no biases
            rows = mx.array([(-BIG, T, T)], dtype=mx.int32)
            table = mx.arange(pages, dtype=mx.int32)[None] if a.paged else None
            launch = ck.Launch(side, vside, parts[0], parts[1], books[0], books[1], rows, T, table=table)
            q = mx.random.normal((1, HQ, 1, D)).astype(getattr(mx, a.q_dtype))
            StandIn.built.clear()
            ck._KERNELS.clear()
            ck.partials(q, launch, plan, D ** -0.5, HKV, fused=True)
            for name, text, grid, block in StandIn.built:
                built = compiled(cc, name, text, f"form {form} {label}")
                if built is None:
                    failed += 1
                    continue
                cubin, counts = built
                line = f"form {form} {label}{' paged' if a.paged else ''}: {counts}, grid {grid}, block {block}"
                if a.sass:
                    out = Path(a.sass)
                    out.mkdir(parents=True, exist_ok=True)
                    stem = f"form{form}-{label.replace(':', '').replace(',', '-')}{'-paged' if a.paged else ''}"
                    sass = cc.sass(cubin, out / f"{stem}.cubin")
                    (out / f"{stem}.sass").write_text(sass)
                    n, ops = hot_loop(sass)
                    line += f", {len(SASS_LINE.findall(sass))} SASS instructions"
                    if n:
                        line += f"; main loop {n} (" + ", ".join(f"{k} {v}" for k, v in ops) + ")"
                print(line, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
