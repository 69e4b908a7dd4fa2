"""Atomic file replacement: write a temp file beside the target, fsync, rename over it.

An interrupted or failed write leaves the target as it was (absent or the old file), never
a truncated one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import MlxkvError


def check_target(path: str | Path) -> Path:
    """Fail early (before a long run) when `path` cannot be written as a file."""
    path = Path(path)
    if path.is_dir():
        raise MlxkvError(f"cannot write {path}: it is a directory")
    if not path.parent.is_dir():
        raise MlxkvError(f"cannot write {path}: folder {path.parent} does not exist")
    if path.exists() and not path.is_file():
        raise MlxkvError(f"cannot write {path}: it exists and is not a regular file")
    check_writable(path.parent, path)
    return path


def check_writable(folder: Path, target: str | Path) -> None:
    """Create and remove a file in `folder`: the only test of writability that holds for every user
    and file system (permission bits say nothing to root or on a read-only mount)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise MlxkvError(f"cannot write {target}: folder {folder} is not writable ({e.strerror or e})") from None


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    path = check_target(path)
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise MlxkvError(f"cannot write {path}: {e.strerror or e}")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it a normal file's mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise MlxkvError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    _fsync_dir(folder)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (not possible on every platform)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
