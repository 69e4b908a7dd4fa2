"""The prefix cache's disk tier (`--prefix-cache-dir`): prompt caches the RAM LRU evicts (and, on a
clean stop, those it still holds) written as mlxkv cache files (kvcore.store: checksummed,
atomic), looked up by longest token prefix when RAM has nothing as long, bounded by bytes.

```
DIR/{tag}-{sha256(prompt ids)[:32]}.kv      tag = sha256(fingerprint)[:16]
fingerprint = the model's (store.model_fingerprint) + the served dtype + the empty caches' layouts
              (+ a served LoRA adapter's sha256, for a prompt run under it: a tag per adapter)
```
A server only reads and evicts files of its own tag, so one folder can serve several models and
KV policies, and a second server process over the folder reuses the first one's prompts. Files
are indexed by the prompt ids they record (read from the header alone); a file is checked in full
(every checksum, the fingerprint) when it is used. Other processes may add or evict files at any
time: the folder is listed again on each lookup, and a file that vanished or fails its checks
is a miss. Writes happen on the engine thread (a file of one prompt's compressed caches); the
hidden temp files of writes a crash interrupted (`.NAME.kv.XXXX.tmp`, store.atomic) are removed at
start once they are older than any write takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from pathlib import Path

from ..engine.reuse import common_prefix
from ..errors import MlxkvError
from ..store import open_cache_file, save_cache
from ..store.atomic import check_writable
from ..store.file import META_KEY, PREFIX
from ..store.layers import kind_of_cache
from ..store.safetensors import open_container

SUFFIX = ".kv"
TEMP = re.compile(r"\.[0-9a-f]{16}-[0-9a-f]{32}" + re.escape(SUFFIX) + r"\..+\.tmp")  # atomic_write's temp files
STALE_TEMP_S = 600.0  # a temp file this old belongs to no running write (one prompt's file takes seconds)


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def serve_fingerprint(model_fp: dict, dtype: str | None, empty_caches: list) -> dict:
    """The model's fingerprint plus what else makes two servers' caches interchangeable."""
    layouts = [kind_of_cache(c).write(c)[0] for c in empty_caches]
    return {**model_fp, "serve_dtype": dtype or "model", "serve_layout_sha256": _sha(layouts)}


def open_folder(folder: str | Path) -> Path:
    """The folder, made if missing; a one-line error if it cannot be written."""
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise MlxkvError(f"--prefix-cache-dir {path}: not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MlxkvError(f"--prefix-cache-dir {path}: cannot create it ({e.strerror or e})") from None
    check_writable(path, path)
    return path


def remove_stale_temps(folder: Path, age: float = STALE_TEMP_S) -> int:
    """Remove the temp files interrupted writes left (any server's: nobody else ever will); newer
    ones may be another server's write in progress and stay. Returns how many went."""
    removed, now = 0, time.time()
    try:
        entries = [e for e in os.scandir(folder) if TEMP.fullmatch(e.name)]
    except OSError:
        return 0
    for e in entries:
        try:
            if e.is_file(follow_symlinks=False) and now - e.stat(follow_symlinks=False).st_mtime > age:
                os.unlink(e.path)
                removed += 1
        except OSError:
            pass
    return removed


class PrefixDisk:
    """The folder's files of this server: the base model's under `fingerprint`'s tag, each served
    adapter's (a folder -> its fingerprint, adapters.py) under its own. Keys are (adapter, ids)."""

    def __init__(self, folder: str | Path, capacity: int, fingerprint: dict, adapters: dict[str, dict] | None = None):
        self.folder, self.capacity, self.fingerprint = open_folder(folder), capacity, fingerprint
        self.fingerprints: dict[str | None, dict] = {None: fingerprint, **(adapters or {})}
        self.tags = {a: _sha(fp)[:16] for a, fp in self.fingerprints.items()}
        self.tag = self.tags[None]
        self._by_tag: dict[str, str | None] = {}
        for a, tag in self.tags.items():
            self._by_tag.setdefault(tag, a)  # two folders of the same weights share their files
        self.index: dict[tuple, tuple[Path, int]] = {}  # (adapter, prompt ids) -> (file, size)
        self._names: dict[str, tuple | None] = {}  # file name -> its key (None: unreadable)
        self.writes = self.loads = self.errors = self.evictions = 0
        self.stale_removed = remove_stale_temps(self.folder)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.index.values())

    def _canon(self, adapter: str | None) -> str | None:
        """The folder files of this adapter's weights are indexed under."""
        return self._by_tag[self.tags[adapter]]

    def path_for(self, key: tuple) -> Path:
        adapter, ids = key
        digest = hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()[:32]
        return self.folder / f"{self.tags[adapter]}-{digest}{SUFFIX}"

    # -- the folder, as other processes left it -----------------------------------------------
    def rescan(self) -> None:
        try:
            found = {e.name: e.stat().st_size for e in os.scandir(self.folder)
                     if e.name[16:17] == "-" and e.name[:16] in self._by_tag and e.name.endswith(SUFFIX)
                     and e.is_file()}
        except OSError:
            found = {}
        for name in list(self._names):
            if name not in found:
                key = self._names.pop(name)
                if key is not None:
                    self.index.pop(key, None)
        for name, size in found.items():
            if name not in self._names:
                adapter = self._by_tag[name[:16]]
                ids = self._peek(self.folder / name, self.fingerprints[adapter])
                key = (adapter, ids) if ids is not None else None
                self._names[name] = key
                if key is not None:
                    self.index[key] = (self.folder / name, size)

    @staticmethod
    def _peek(path: Path, fingerprint: dict) -> tuple[int, ...] | None:
        """The prompt ids a file records, from its header (None: not one of ours, or damaged)."""
        try:
            c = open_container(path)
            doc = json.loads(c.metadata.get(META_KEY, "null"))
            t = c.tensors.get(PREFIX)
            if not isinstance(doc, dict) or doc.get("model") != fingerprint or t is None or t.dtype != "int32":
                return None
            return tuple(struct.unpack(f"<{t.nbytes // 4}i", c.read(t)))
        except (MlxkvError, ValueError, RecursionError, struct.error):
            return None

    # -- lookups and writes ------------------------------------------------------------------
    def best(self, adapter: str | None, ids: list[int]) -> tuple[tuple, int]:
        """The indexed prompt of `adapter` sharing the longest prefix with `ids`, and that length."""
        if adapter not in self.tags:
            return (), 0
        adapter = self._canon(adapter)
        self.rescan()
        key = max((k for k in self.index if k[0] == adapter), key=lambda k: common_prefix(k[1], ids), default=None)
        return (key, common_prefix(key[1], ids)) if key is not None else ((), 0)

    def load(self, key: tuple) -> list | None:
        """The caches of that file (fully checked), or None (vanished, damaged, not ours)."""
        path, _ = self.index[key]
        try:
            cf = open_cache_file(path)
            if cf.fingerprint != self.fingerprints[key[0]] or tuple(cf.prefix_ids) != key[1]:
                raise MlxkvError("not this server's prompt")
            caches = cf.restore()
            os.utime(path)  # the newest file now, for eviction
        except (MlxkvError, OSError):
            self.errors += 1
            self.index.pop(key, None)
            return None
        self.loads += 1
        return caches

    def save(self, key: tuple, caches: list, nbytes: int) -> None:
        """Write one prompt's caches (not if they alone exceed the bound, or its adapter has no
        fingerprint here), then evict the oldest files beyond it."""
        adapter, ids = key
        if nbytes > self.capacity or adapter not in self.tags:
            return
        key = (self._canon(adapter), ids)
        if key in self.index:
            return
        path = self.path_for(key)
        try:
            size = save_cache(path, caches, list(ids), self.fingerprints[key[0]])
        except (MlxkvError, OSError):
            self.errors += 1
            return
        self.writes += 1
        self._names[path.name] = key
        self.index[key] = (path, size)
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        def mtime(p: Path) -> float:
            try:
                return p.stat().st_mtime
            except OSError:
                return 0.0

        by_age = sorted(((mtime(p), key) for key, (p, _) in self.index.items() if p != keep), key=lambda t: t[0])
        for _, key in by_age:
            if self.nbytes <= self.capacity:
                return
            path, _ = self.index.pop(key)
            self._names.pop(path.name, None)
            try:
                path.unlink()
                self.evictions += 1
            except FileNotFoundError:
                pass
            except OSError:
                self.errors += 1
