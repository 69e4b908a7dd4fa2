"""Hugging Face repo ids: the local cache first, a download through huggingface_hub otherwise.

Only the files mlx-lm loads are fetched (its DEFAULT_ALLOW_PATTERNS). Nothing is downloaded
while offline (`HF_HUB_OFFLINE=1`, or the caller says so). `HF_ENDPOINT` points huggingface_hub
at another hub (tests serve one on loopback).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Callable

from .errors import MlxkvError

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, file name)


def env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _patterns() -> list[str]:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def cached_snapshot(repo: str) -> Path | None:
    """The repo's folder in the local cache, if every file mlx-lm needs is there."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=_patterns()))
    except Exception:  # not cached, incomplete, or a name the hub library rejects
        return None


class _Bytes:
    """A tqdm stand-in for hf_hub_download: forwards byte counts to a callback."""

    def __init__(self, on_bytes: Callable[[int], None], *args, **kwargs):
        self._on_bytes = on_bytes
        if kwargs.get("initial"):
            on_bytes(int(kwargs["initial"]))

    def update(self, n=1):
        self._on_bytes(int(n or 0))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # close, refresh, set_postfix_str, update_transfer, ...: nothing to do
        return lambda *a, **k: None


def download(repo: str, progress: Progress | None = None) -> Path:
    """Fetch `repo` (the files mlx-lm loads) into the local cache; `progress` after each chunk."""
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except Exception as e:
        raise MlxkvError(f"cannot download {repo!r}: {_reason(e)}") from None
    patterns = _patterns()
    files = [(s.rfilename, s.size or 0) for s in info.siblings or []
             if any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)]
    if not any(name == "config.json" for name, _ in files):
        raise MlxkvError(f"cannot download {repo!r}: it has no config.json (not an mlx-lm / Hugging Face model)")
    total, done = sum(size for _, size in files), 0
    for name, size in files:
        start = done

        def on_bytes(n: int, name=name, start=start, size=size):
            nonlocal done
            done = min(done + n, start + size) if size else done + n
            if progress:
                progress(done, total, name)

        bar = {"tqdm_class": lambda *a, **k: _Bytes(on_bytes, *a, **k)} if _takes_tqdm(hf_hub_download) else {}
        try:
            hf_hub_download(repo, name, **bar)  # revision main: the cache records it (refs/main)
        except Exception as e:
            raise MlxkvError(f"cannot download {repo!r} ({name}): {_reason(e)}") from None
        done = start + size
        if progress:
            progress(done, total, name)
    path = cached_snapshot(repo)
    if path is None:
        raise MlxkvError(f"downloaded {repo!r} but the local cache does not hold it whole")
    return path


def _takes_tqdm(fn) -> bool:  # older huggingface_hub: per-file progress only
    import inspect

    return "tqdm_class" in inspect.signature(fn).parameters


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
