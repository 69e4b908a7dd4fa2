"""Cache files under 2 ranks: one file per rank, continued on the same layout, refused on another."""

import json
import sys
from pathlib import Path

import pytest
from mlx_lm import load

from dist_helpers import MLXKV, launch, needs_launch, single
from dist_store_rank import FIRST, OPTS
from helpers import ours
from kvcore.engine.prompt import encode_continuation, encode_prompt
from kvcore.errors import MlxkvError
from kvcore.store import Sharding, check_sharding, open_cache_file, rank_path
from kvcore.store.sharding import set_paths
from store_helpers import MORE, cli, job

SCRIPT = Path(__file__).with_name("dist_store_rank.py")


@pytest.fixture(scope="module")
def two_ranks(tiny_models, tmp_path_factory):
    """(model path, output folder, [rank 0's results, rank 1's]) of one 2-rank run of dist_store_rank.py."""
    model, out = str(tiny_models("llama")), tmp_path_factory.mktemp("dist_store")
    r = launch(f"{sys.executable} {SCRIPT} {model} {out}", 35200, timeout=180)
    results = [out / f"rank{i}.json" for i in range(2)]
    assert all(p.exists() for p in results), r.stderr[-3000:]
    return model, out, [json.loads(p.read_text()) for p in results]


@needs_launch
def test_continuing_a_two_rank_cache_equals_one_run(two_ranks):
    model_path, _, ranks = two_ranks
    model, tok = load(model_path)
    one_process, _ = ours(model, tok, ranks[0]["ids"], len(ranks[0]["reference"]), OPTS)
    first_alone, _ = ours(model, tok, encode_prompt(tok, FIRST), 6, OPTS)
    for r in ranks:
        assert r["again"] == r["reference"] == one_process and len(one_process) >= 8
        assert r["first"] == first_alone and r["ids"] == ranks[0]["ids"]
        assert not [n for n in r["notices"] if "KV policy" in n or "cannot reuse" in n or "diverges" in n]
        assert r["again_prompt_tokens"] == len(encode_continuation(tok, MORE))  # only the continuation was fed


@needs_launch
def test_rank_files_record_their_sharding(two_ranks):
    _, out, _ = two_ranks
    for rank in range(2):
        cf = open_cache_file(rank_path(out / "run.kv", rank, 2))
        assert cf.header["version"] == 3 and cf.header["sharding"] == {"ranks": 2, "rank": rank, "kv_heads": 1}
        assert cf.layers[0]["dims"][1] == 1 and cf.layers[0]["enc"] >= 2  # its own KV head, 4-bit blocks
    assert (out / "run.rank1-of-2.kv").exists() and not (out / "run.rank0-of-2.kv").exists()


@needs_launch
def test_a_set_mixing_two_saves_is_refused_on_every_rank(two_ranks):
    for r in two_ranks[2]:
        assert "rank 1's cache file holds other tokens or KV settings than rank 0's" in r["mixed_error"]


@needs_launch
def test_a_converted_set_continues(two_ranks):
    _, out, ranks = two_ranks
    assert "convert the other ranks' files with the same flags to" in ranks[0]["convert_notices"][-1]
    assert ranks[0]["converted"] == ranks[1]["converted"] and len(ranks[0]["converted"]) >= 8
    assert open_cache_file(out / "conv.rank1-of-2.kv").sharding == Sharding(2, 1, 1)


@needs_launch
def test_rank_files_are_refused_in_one_process(two_ranks):
    model, out, _ = two_ranks
    for name, says in (("run.kv", "holds rank 0 of 2's KV heads"), ("run.rank1-of-2.kv", "holds rank 1 of 2's")):
        r = single(["generate", "-m", model, "--load-cache", str(out / name), "x", "-n", "2"])
        assert r.returncode == 1 and says in r.stderr and "under mlx.launch with 2 ranks" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@needs_launch
def test_a_single_process_file_is_refused_on_every_rank(tiny_models, tmp_path):
    model, f = str(tiny_models("llama")), tmp_path / "one.kv"
    job("Once upon a time", model, 3, OPTS, save_cache=str(f))
    r = launch(f"{MLXKV} generate -m {model} --load-cache {f} x -n 2", 35240, timeout=90)
    # mlx.launch itself exits 0; it stops the other ranks once one has exited (after they printed)
    assert "exited with code 1" in r.stderr and r.stderr.count("error: ") == 2, r.stderr[-2000:]
    assert "it was saved by a single process, this run has 2 ranks" in r.stderr  # rank 0
    assert f"rank 1's file {tmp_path / 'one.rank1-of-2.kv'} not found" in r.stderr  # rank 1
    assert "no answer from the other ranks" not in r.stderr and "Traceback" not in r.stderr


@needs_launch
def test_inspect_shows_a_rank_file_sharding(two_ranks):
    _, out, _ = two_ranks
    report = json.loads(cli("inspect-cache", out / "run.rank1-of-2.kv", "--json").stdout)
    assert report["sharding"] == {"ranks": 2, "rank": 1, "kv_heads": 1,
                                  "set": [str(out / "run.kv"), str(out / "run.rank1-of-2.kv")]}
    text = cli("inspect-cache", out / "run.rank1-of-2.kv").stdout
    assert "sharding: rank 1 of 2, 1 KV heads per rank; continues only under 2 ranks, as rank 1" in text


def test_rank_paths():
    assert rank_path("a/out.kv", 0, 2) == Path("a/out.kv") and rank_path("a/out.kv", 5, 1) == Path("a/out.kv")
    assert rank_path("a/out.kv", 3, 4) == Path("a/out.rank3-of-4.kv") and rank_path("o", 1, 2) == Path("o.rank1-of-2")
    assert set_paths("x.rank1-of-2.kv", Sharding(2, 1)) == [Path("x.kv"), Path("x.rank1-of-2.kv")]
    assert set_paths("renamed.kv", Sharding(2, 1)) is None


@pytest.mark.parametrize("saved,current,says", [
    (Sharding(), Sharding(2, 1, 1), "saved by a single process, this run has 2 ranks"),
    (Sharding(2, 0, 1), Sharding(), "holds rank 0 of 2's KV heads"),
    (Sharding(2, 0, 1), Sharding(4, 0, 1), "saved under 2 ranks, this run has 4"),
    (Sharding(2, 1, 1), Sharding(2, 0, 1), "holds rank 1's KV heads, this is rank 0"),
    (Sharding(2, 1, 2), Sharding(2, 1, 1), "2 KV heads per rank, this rank's model shard has 1"),
])
def test_another_layout_is_refused(saved, current, says):
    with pytest.raises(MlxkvError, match=says):
        check_sharding(saved, current)
    check_sharding(saved, saved)


@needs_launch
def test_speculative_decoding_on_two_ranks_is_refused_by_name(tiny_models):
    """The speculative job loads as plain runs do (load_for_run); under 2 ranks it says why it stops."""
    model = str(tiny_models("llama"))
    r = launch(f"{MLXKV} generate -m {model} -p 'Tom and' -n 4 --draft prompt-lookup", 35260, timeout=120)
    assert r.stderr.count("speculative decoding runs on one rank; this launch has 2") >= 1, r.stderr[-2000:]
    assert "exited with code 1" in r.stderr  # mlx.launch itself exits 0; the ranks did not
    assert "Traceback" not in r.stderr
