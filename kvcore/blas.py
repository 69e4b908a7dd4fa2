"""Is MLX's CPU matmul backed by an optimized BLAS in this process?

The Linux `mlx[cpu]` wheel links a bundled reference (netlib) BLAS, ~2.5 GFLOP/s.
An OpenBLAS preloaded with LD_PRELOAD takes over `sgemm_` for libmlx (the global
symbol scope is searched before libmlx's own dependencies), which made float32
matmuls ~6x faster on a 2-core VM and ~65x on a larger one.

Detection: after importing mlx, ask the dynamic linker which library the global
`sgemm_` resolves to (dlsym + dladdr); no timing, a few microseconds.

Pitfall: OpenBLAS 0.3.21 (Debian 12) does not know recent Xeons (e.g. model 207)
and falls back to its SSE3 "Prescott" kernels (~30 GFLOP/s instead of ~200 here);
OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) fixes it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class BlasStatus:
    optimized: bool
    library: str | None  # e.g. "OpenBLAS 0.3.21 ... (/usr/lib/.../libblas.so.3)"
    hint: str | None  # one line: how to get an optimized BLAS


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def openblas_candidates() -> list[str]:
    """OpenBLAS paths for this machine's architecture: Debian/Ubuntu, then Fedora/Arch (the same
    list as mlxkv_cli/blas_preload.py, which preloads the first one found before mlx is imported)."""
    triple = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(
        platform.machine(), f"{platform.machine()}-linux-gnu")
    base = f"/usr/lib/{triple}"
    return [f"{base}/openblas-pthread/libblas.so.3", f"{base}/openblas-openmp/libblas.so.3",
            f"{base}/libopenblas.so.0", "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0",
            "/usr/lib/libopenblas.so.0"]


_OLD_CORES = ("Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai",
              "Coppermine", "Northwood", "Banias")


def recommended_coretype() -> str | None:
    """OPENBLAS_CORETYPE matching this CPU's vector units (x86 Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return None
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        return "SkylakeX"
    if {"avx2", "fma"} <= set(flags):
        return "Haswell"
    return None


def _global_provider(symbol: str) -> str | None:
    """Path of the library whose `symbol` wins in the process-wide scope."""
    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    if not addr or not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode()) if info.dli_fname else None


def _mapped_libs() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _describe(path: str) -> tuple[bool, str]:
    """(optimized?, description) of a BLAS library file already mapped in."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        lib = None
    name = os.path.basename(path).lower()
    if lib is not None and hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        return True, f"{lib.openblas_get_config().decode().strip()} ({path})"
    if (lib is not None and hasattr(lib, "mkl_get_version_string")) or "mkl" in name:
        return True, f"MKL ({path})"
    if (lib is not None and hasattr(lib, "bli_info_get_version_str")) or "blis" in name:
        return True, f"BLIS ({path})"
    if "openblas" in name or "armpl" in name or "atlas" in name:
        return True, path
    return False, f"reference BLAS ({path})"


def _hint() -> str:
    for cand in openblas_candidates():
        if os.path.exists(cand):
            return (f"slow reference BLAS in use: export LD_PRELOAD={cand} "
                    f"(the mlxkv command does it by itself; or source scripts/blas-env.sh) for much faster CPU matmuls")
    return ("slow reference BLAS in use: apt-get install libopenblas0-pthread libgfortran5, "
            f"then export LD_PRELOAD={openblas_candidates()[0]}")


@lru_cache(maxsize=1)
def blas_status() -> BlasStatus:
    """Which BLAS MLX's CPU matmuls use here (cached: it cannot change in-process)."""
    import mlx.core as mx  # load libmlx (and its bundled BLAS) first

    if sys.platform == "darwin":
        return BlasStatus(True, "Accelerate", None)
    if mx.default_device() == mx.gpu:
        return BlasStatus(True, "GPU (cuBLAS)", None)
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, None, None)
    provider = _global_provider("sgemm_")
    if provider is None:  # nothing global: libmlx uses the BLAS it was linked with
        blas = [p for p in _mapped_libs() if "blas" in os.path.basename(p).lower()
                and "scipy_openblas" not in p]  # numpy's copy has renamed symbols
        provider = blas[0] if blas else None
    if provider is None:
        return BlasStatus(False, None, _hint())
    optimized, desc = _describe(provider)
    if not optimized:
        return BlasStatus(False, desc, _hint())
    core = recommended_coretype()
    if desc.startswith("OpenBLAS") and core and any(f" {c} " in desc for c in _OLD_CORES):
        return BlasStatus(True, desc, f"OpenBLAS chose old SSE kernels for this CPU: export "
                          f"OPENBLAS_CORETYPE={core} (scripts/blas-env.sh does) "
                          f"for ~5x faster matmuls")
    return BlasStatus(True, desc, None)
