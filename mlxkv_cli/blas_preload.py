"""OpenBLAS by default on Linux CPUs: `mlxkv` re-execs itself once with it preloaded.

The Linux mlx[cpu] wheel links a bundled reference BLAS, 16-65x slower than the system
OpenBLAS. An OpenBLAS in LD_PRELOAD takes over libmlx's `sgemm_`, but the dynamic linker reads
LD_PRELOAD only when a process starts, before mlx is imported: so the entry point, finding an
installed OpenBLAS not yet loaded, execs the same command again with it preloaded (and with
OPENBLAS_CORETYPE set where OpenBLAS would fall back to its SSE3 kernels, as
scripts/blas-env.sh does). Standard library only: nothing here may import mlx.

MLXKV_NO_OPENBLAS=1 opts out; MLXKV_OPENBLAS=PATH names another OpenBLAS (a non-Debian path),
or one that does not exist to behave as if none were installed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

REEXEC = "MLXKV_BLAS_REEXEC"  # set in the re-exec'd process: never twice
HINT = ("MLX's CPU matmuls use its slow bundled reference BLAS here; installing OpenBLAS "
        "(apt-get install libopenblas0-pthread) makes them 16-65x faster, and mlxkv then uses it by itself")


def candidates() -> list[str]:
    """OpenBLAS libraries to preload, most preferred first (Debian/Ubuntu, then Fedora/Arch);
    kvcore.blas.openblas_candidates lists the same paths (a test keeps them equal)."""
    machine = platform.machine()
    triple = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")
    base = f"/usr/lib/{triple}"
    return [f"{base}/openblas-pthread/libblas.so.3", f"{base}/openblas-openmp/libblas.so.3",
            f"{base}/libopenblas.so.0", "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0",
            "/usr/lib/libopenblas.so.0"]


def find_openblas(env: dict[str, str]) -> str | None:
    named = env.get("MLXKV_OPENBLAS")
    if named:
        return named if os.path.isfile(named) else None
    return next((c for c in candidates() if os.path.isfile(c)), None)


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def _coretype(lib: str, env: dict[str, str]) -> str | None:
    """OPENBLAS_CORETYPE for this CPU if OpenBLAS would pick its old Prescott kernels, else None."""
    if env.get("OPENBLAS_CORETYPE") or platform.machine() != "x86_64":
        return None
    try:
        out = subprocess.run(["/bin/true"], env={**env, "LD_PRELOAD": lib, "OPENBLAS_VERBOSE": "2"},
                             capture_output=True, text=True, timeout=10)
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except (OSError, subprocess.SubprocessError):
        return None
    if "Core: Prescott" not in out.stdout + out.stderr:
        return None
    return "SkylakeX" if {"avx512f", "avx512bw"} <= flags else "Haswell" if {"avx2", "fma"} <= flags else None


def preload_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-exec with, or None (not Linux, opted out, already done, none installed)."""
    if not sys.platform.startswith("linux") or _truthy(env.get("MLXKV_NO_OPENBLAS")) or env.get(REEXEC):
        return None
    lib = find_openblas(env)
    preloaded = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if lib is None or any("openblas" in os.path.realpath(p).lower() or p == lib for p in preloaded):
        return None
    new = {**env, REEXEC: "1", "LD_PRELOAD": ":".join([lib, *preloaded])}
    core = _coretype(lib, env)
    if core:
        new["OPENBLAS_CORETYPE"] = core
    return new


def reexec_with_openblas() -> None:
    """Exec this same command again with OpenBLAS preloaded, when that applies (else return)."""
    if "mlx" in sys.modules or "mlx.core" in sys.modules:
        return  # too late: libmlx is loaded with its own BLAS
    env = preload_env(dict(os.environ))
    if env is None:
        return
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # could not exec: carry on with the bundled BLAS


def reference_blas_hint() -> str | None:
    """One line for a Linux CPU run without an optimized BLAS and no OpenBLAS installed, else None."""
    env = os.environ
    if not sys.platform.startswith("linux") or _truthy(env.get("MLXKV_NO_OPENBLAS")) or find_openblas(dict(env)):
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    from kvcore.blas import blas_status

    return None if blas_status().optimized else HINT
