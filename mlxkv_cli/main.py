"""mlxkv: the table of contents of the command line."""

from __future__ import annotations

import os
import sys


def _check_backend() -> None:
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        from kvcore.errors import first_line  # kvcore's package imports no MLX

        print(
            "error: MLX has no backend here (" + first_line(e, None) + "); on Linux install an extra: "
            "pip install 'mlxkv[cpu]' (CPU) or 'mlxkv[cuda]' (NVIDIA CUDA 13)",
            file=sys.stderr,
        )
        sys.exit(1)


def build_app():
    import typer

    from kvcore import __version__

    from .bench import bench
    from .chat import chat
    from .calibrate import calibrate
    from .convert_kv import convert_kv
    from .convert_model import convert_model
    from .errors import MlxkvGroup
    from .fidelity import fidelity
    from .fit import fit
    from .generate import generate
    from .inspect_cache import inspect_cache
    from .serve import ServeCommand, serve

    app = typer.Typer(cls=MlxkvGroup, no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False, help="Run MLX language models with compressed KV caches.")

    def version_callback(value: bool):
        if value:
            import mlx.core as mx
            import mlx_lm

            print(f"mlxkv {__version__} (mlx {mx.__version__}, mlx-lm {mlx_lm.__version__})")
            if mx.default_device() == mx.cpu:
                from kvcore.blas import blas_status

                print(f"cpu blas: {blas_status().library or 'unknown'}")
            raise typer.Exit()

    @app.callback()
    def root(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                          help="Show versions and exit.")):
        pass

    app.command("generate")(generate)
    app.command("chat")(chat)
    app.command("convert-kv")(convert_kv)
    app.command("inspect-cache")(inspect_cache)
    app.command("convert-model")(convert_model)
    app.command("bench")(bench)
    app.command("fit")(fit)
    app.command("fidelity")(fidelity)
    app.command("calibrate")(calibrate)
    app.command("serve", cls=ServeCommand)(serve)
    return app


def _quiet_other_ranks() -> None:
    """Under a multi-rank launcher only rank 0 prints; other ranks still report their errors."""
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank != "0":
        from . import bench_output, output

        sink = open(os.devnull, "w")
        sys.stdout = sink
        for module in (output, bench_output):
            module.err.file = sink
        bench_output.out.file = sink


def main() -> None:
    from .blas_preload import reexec_with_openblas, reference_blas_hint

    reexec_with_openblas()  # before mlx is imported: an installed OpenBLAS instead of MLX's reference BLAS
    _check_backend()
    _quiet_other_ranks()
    hint = reference_blas_hint()
    if hint:
        from .output import notice

        notice(hint + " (MLXKV_NO_OPENBLAS=1 silences this)")
    build_app()()


def __getattr__(name):  # `from mlxkv_cli.main import app` for CliRunner
    if name == "app":
        return build_app()
    raise AttributeError(name)
