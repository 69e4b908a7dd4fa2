"""The one place where errors become a one-line message and an exit code."""

from __future__ import annotations

import os
import sys
import traceback

import typer
try:
    from typer._click import exceptions as click_errors  # newer typer vendors its own click
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors
from typer.core import TyperGroup

from kvcore.errors import MlxkvError, first_line


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


class MlxkvGroup(TyperGroup):
    """Typer's group, but every failure ends in one line on stderr and a non-zero exit."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except click_errors.NoArgsIsHelpError as e:
            print(e.ctx.get_help())
            sys.exit(0)
        except click_errors.ClickException as e:
            _fail(e.format_message().replace("\n", " "), e.exit_code)
        except typer.Abort:
            _fail("aborted", 130)
        except MlxkvError as e:
            _fail(first_line(e, limit=None), 1)
        except BrokenPipeError:
            sys.exit(1)
        except OSError as e:  # a file no check caught (the checks name most): still name it
            if os.environ.get("MLXKV_DEBUG"):
                traceback.print_exc()
            where = f"{e.filename}: " if e.filename else ""
            _fail(f"{where}{e.strerror or e}", 1)
        except RecursionError:
            _fail("an input is nested too deeply to read (JSON or TOML?)", 1)
        except Exception as e:  # the last resort: still one line unless debugging
            if os.environ.get("MLXKV_DEBUG"):
                traceback.print_exc()
            first = first_line(e, None, empty="")
            _fail(f"internal error: {type(e).__name__}: {first} (set MLXKV_DEBUG=1 for the traceback)", 1)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        return rv
