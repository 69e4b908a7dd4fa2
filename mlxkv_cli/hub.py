"""`-m org/repo` not in the local Hugging Face cache: download it first, with progress on stderr.

`--offline` or HF_HUB_OFFLINE=1 skips the download: the model must already be local, and a
missing one is kvcore's one-line error.
"""

from __future__ import annotations

from kvcore.hub import cached_snapshot, download, env_offline
from kvcore.models import is_repo_id

from .output import err
from .progress import byte_bar


def fetch_model(ref: str | None, offline: bool) -> None:
    """Make `ref` local if it is a repo id that is not cached (nothing to do otherwise)."""
    if offline or env_offline() or not is_repo_id(ref) or cached_snapshot(ref) is not None:
        return
    with byte_bar(err, f"downloading {ref}") as update:
        download(ref, update)
