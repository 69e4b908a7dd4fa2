"""`-m org/repo` not in the local cache downloads through huggingface_hub, offline: from a fake hub
served on loopback (HF_ENDPOINT), in a subprocess (huggingface_hub reads its settings at import)."""

import json
import os
import subprocess
import sys

from fake_hub import FakeHub

REPO = "fake-org/tiny-stories"


def mlxkv(args, env):
    return subprocess.run([sys.executable, "-m", "mlxkv_cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_a_repo_id_downloads_with_progress_then_runs_from_the_cache(default_model_dir, tmp_path):
    with FakeHub(REPO, default_model_dir) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1",
               "no_proxy": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        off = mlxkv(["generate", "-m", REPO, "Once upon a time", "-n", "4"], {**env, "HF_HUB_OFFLINE": "1"})
        assert off.returncode == 1 and "not available locally" in off.stderr and not hub.requests, off.stderr

        r = mlxkv(["generate", "-m", REPO, "Once upon a time", "-n", "4", "--json"], env)
        assert r.returncode == 0, r.stderr
        assert f"downloading {REPO}" in r.stderr  # progress on stderr (lines in a pipe)
        got = [json.loads(x) for x in r.stdout.splitlines()]
        assert got[-1]["model"] == REPO and got[0]["generated_tokens"] == 4
        served = {q.split()[1].rsplit("/", 1)[-1] for q in hub.requests if q.startswith("GET") and "/resolve/" in q}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= served and "LICENSE" not in served
        n = len(hub.requests)
        again = mlxkv(["generate", "-m", REPO, "Once upon a time", "-n", "4", "--json", "--offline"], env)
        assert again.returncode == 0 and len(hub.requests) == n, again.stderr  # from the cache, no request
        assert [json.loads(x) for x in again.stdout.splitlines()][0]["token_ids"] == got[0]["token_ids"]


def test_a_repo_the_hub_lacks_is_one_line(default_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    import pytest

    from kvcore.errors import MlxkvError
    from kvcore.hub import download

    with FakeHub(REPO, default_model_dir) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read at import: patch the constants
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        with pytest.raises(MlxkvError, match="cannot download 'fake-org/absent': .*404"):
            download("fake-org/absent")
        seen = []
        path = download(REPO, lambda done, total, name: seen.append((done, total)))
    assert (path / "config.json").is_file() and seen[-1][0] == seen[-1][1] == sum(
        p.stat().st_size for p in path.iterdir() if p.name != "LICENSE" and p.name != "SOURCE.md")
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))  # bytes only grow
