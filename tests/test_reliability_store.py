"""Cache files under bad input: a damaged document, old versions, files mlxkv would refuse, FIFOs,
symlink loops and unwritable targets. Each is one error line, nothing half-written, nothing hangs."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from store_helpers import DOC, cli, job, join, split

from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec
from kvcore.errors import MlxkvError
from kvcore.models import load_model
from kvcore.policy import KVOptions
from kvcore.store import model_fingerprint, open_cache_file, save_cache

OPTS = KVOptions(max_kv_size=32, keep=4, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
A4 = CodecSpec("affine", 4, 32)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    f = tmp_path_factory.mktemp("rel") / "good.kv"
    job(DOC * 2, None, 4, OPTS, save_cache=str(f))
    return f


def one_line_error(r, message: str) -> None:
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "internal error" not in lines[0], r.stderr


def flip(data: bytes, old: bytes, new: bytes) -> bytes:
    """Replace the first `old` by `new`, which differs from it in one bit."""
    assert len(old) == len(new) and sum(bin(a ^ b).count("1") for a, b in zip(old, new)) == 1
    i = data.index(old)
    return data[:i] + new + data[i + len(old):]


# -- the document's checksum ----------------------------------------------------------------------
@pytest.mark.parametrize("old,new", [(b'\\"window\\": 32', b'\\"window\\": 33'),
                                     (b'\\"recent\\": 0', b'\\"recent\\": 8'),
                                     (b'\\"version\\": 3', b'\\"version\\": 1')],
                         ids=["window", "recent", "version downgrade"])
def test_one_bit_flip_in_the_document_is_refused(good, tmp_path, old, new):
    bad = tmp_path / "bad.kv"
    bad.write_bytes(flip(good.read_bytes(), old, new))
    with pytest.raises(MlxkvError, match="checksum mismatch for the mlxkv document"):
        open_cache_file(bad)
    one_line_error(cli("generate", "-p", " She", "-n", "2", "--load-cache", bad), "checksum mismatch")
    one_line_error(cli("inspect-cache", bad), "checksum mismatch")


def _as_version(good: Path, out: Path, version: int | None, keep_sum: bool) -> Path:
    header, data = split(good)
    meta = header["__metadata__"]
    if version is not None:
        meta["mlxkv"] = meta["mlxkv"].replace('"version": 3', f'"version": {version}')
    if not keep_sum:
        del meta["mlxkv_sha256"]
    out.write_bytes(join(header, data))
    return out


def test_version_1_files_are_still_read(good, tmp_path):
    """Files of the previous format (no document checksum) load and continue as before."""
    old = _as_version(good, tmp_path / "v1.kv", 1, keep_sum=False)
    assert open_cache_file(old).header["version"] == 1
    a, b = (cli("generate", "-p", " She", "-n", "4", "--load-cache", f) for f in (good, old))
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout, (a.output, b.output)
    r = cli("inspect-cache", old)
    assert r.exit_code == 0 and "mlxkv-kv 1" in r.stdout


def test_version_3_without_its_checksum_is_refused(good, tmp_path):
    bad = _as_version(good, tmp_path / "nosum.kv", None, keep_sum=False)
    with pytest.raises(MlxkvError, match="must carry 'mlxkv_sha256'"):
        open_cache_file(bad)


# -- mlxkv never writes a file it refuses to read ------------------------------------------------
def test_save_refuses_a_cache_the_reader_would_refuse(tmp_path):
    """A cache built past the policy's checks (negative keep) is not written: the same rules as on load."""
    lm = load_model()
    c = CompressedKVCache(A4, A4, start=0, window=32, keep=-3)
    k = mx.random.normal((1, 2, 10, 8))
    c.update_and_fetch(k, k)
    out = tmp_path / "neg.kv"
    with pytest.raises(MlxkvError, match=r"not saving .*'keep' must be an integer >= 0"):
        save_cache(out, [c] * 5, list(range(1, 11)), model_fingerprint(lm.model, lm.tokenizer, lm.config))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_negative_keep_is_refused_before_the_run(tmp_path):
    out = tmp_path / "c.kv"
    one_line_error(cli("generate", "-p", "x", "-n", "2", "--max-kv-size", "32", "--kv-keep", "-3",
                       "--save-cache", out), "--kv-keep must be >= 0")
    assert not out.exists()


def test_a_long_recent_window_saves_and_loads(tmp_path):
    """`/r100000` was accepted by the flags and written, then refused on load."""
    out = tmp_path / "r.kv"
    r = cli("generate", "-p", "Once", "-n", "3", "--kv", "affine:4/g32/r100000", "--save-cache", out)
    assert r.exit_code == 0, r.output
    r = cli("generate", "-p", " upon", "-n", "3", "--load-cache", out)
    assert r.exit_code == 0, r.output


# -- only regular files are opened ----------------------------------------------------------------
def _within(seconds: float, fn):
    """fn()'s result, or a failure if it is still running after `seconds` (a hang)."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (blocked on a FIFO?)"
    return result["r"]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.kv"
    os.mkfifo(path)
    yield path
    try:  # unblock anything left waiting on it
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def test_a_fifo_is_refused_not_waited_on(fifo, tmp_path):
    out = tmp_path / "out.kv"
    for args in (("generate", "-p", "x", "-n", "2", "--load-cache", fifo), ("inspect-cache", fifo),
                 ("convert-kv", fifo, out, "--kv-bits", "8")):
        one_line_error(_within(20, lambda args=args: cli(*args)), "is a FIFO (named pipe), not a regular file")
    assert not out.exists()


def test_a_symlink_loop_is_named(tmp_path):
    loop = tmp_path / "loop.kv"
    loop.symlink_to(loop)
    out = tmp_path / "out.kv"
    for args in (("convert-kv", loop, out, "--kv-bits", "8"), ("inspect-cache", loop),
                 ("generate", "-p", "x", "-n", "2", "--load-cache", loop)):
        one_line_error(cli(*args), "symbolic links")
    assert not out.exists()


# -- output targets are checked before the work --------------------------------------------------
@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot create files in (permission bits do not bind root: then /sys)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError:
        yield d
    else:
        sys_dir = Path("/sys")
        try:
            tempfile.TemporaryFile(dir=sys_dir).close()
        except OSError:
            yield sys_dir
        else:
            pytest.skip("no folder here refuses writes to this user")
    finally:
        d.chmod(0o755)


def test_unwritable_targets_fail_before_the_run(read_only_dir, tmp_path, good):
    target = read_only_dir / "out.kv"
    r = cli("generate", "-p", "x", "-n", "2", "--save-cache", target)
    one_line_error(r, "is not writable")
    assert r.stdout == ""  # refused before anything was generated
    one_line_error(cli("convert-kv", good, target, "--kv-bits", "8"), "is not writable")
    one_line_error(cli("convert-kv", good, tmp_path / "no" / "out.kv", "--kv-bits", "8"), "does not exist")
    bench = ("bench", "--kv", "full", "--context", "8", "--gen", "2", "--repeats", "1", "--no-baseline")
    for out in (read_only_dir / "b.json", tmp_path / "missing" / "b.json"):
        r = cli(*bench, "--output", out)
        one_line_error(r, "cannot write")
        assert r.stdout == ""  # refused before the bench ran
