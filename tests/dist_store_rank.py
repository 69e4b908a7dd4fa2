"""Run on each of 2 ranks by test_distributed_store.py: `python dist_store_rank.py MODEL OUT`.

Saves a 2-rank cache, continues from it, computes the uninterrupted 2-rank reference on the same
tokens, converts the set, and tries a set mixing two saves; rank r writes what it saw to
OUT/rank{r}.json (one process per rank, so the imports are paid once).
"""

import json
import shutil
import sys
from pathlib import Path

from helpers import ours
from kvcore.distributed import load_for_run
from kvcore.engine.prompt import encode_continuation
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, resolve_policy
from kvcore.store import convert_cache_file, open_cache_file, rank_path
from store_helpers import DOC, MORE, job

OPTS = KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
FIRST, N = DOC * 3, 12  # > 64 cached tokens: whole 32-token blocks are encoded


def main(model: str, out: Path) -> None:
    run, other, mixed, conv = (out / n for n in ("run.kv", "other.kv", "mixed.kv", "conv.kv"))
    first, _ = job(FIRST, model, 6, OPTS, save_cache=str(run))
    again, notices = job(MORE, model, N, OPTS, load_cache=str(run))

    lm, dist = load_for_run(model, None, "reference")
    mine = rank_path(run, dist.rank, dist.size)
    prefix = open_cache_file(mine).prefix_ids
    ids = prefix + encode_continuation(lm.tokenizer, MORE)
    reference, _ = ours(lm.model, lm.tokenizer, ids, N, OPTS)  # uninterrupted, on this rank's shard

    job("The dog ran to the park", model, 3, OPTS, save_cache=str(other))
    shutil.copy(rank_path(run if dist.rank == 0 else other, dist.rank, 2), rank_path(mixed, dist.rank, 2))
    try:
        job(MORE, model, 2, OPTS, load_cache=str(mixed))
        mixed_error = None
    except MlxkvError as e:
        mixed_error = str(e)

    policy = resolve_policy(KVOptions(kv_bits=8, kv_group_size=32))
    conversion = convert_cache_file(mine, rank_path(conv, dist.rank, 2), policy)
    converted, _ = job(MORE, model, N, load_cache=str(conv))

    (out / f"rank{dist.rank}.json").write_text(json.dumps({
        "first": first.completions[0].token_ids, "again": again.completions[0].token_ids,
        "again_prompt_tokens": again.completions[0].prompt_tokens, "notices": notices,
        "ids": ids, "reference": reference, "mixed_error": mixed_error,
        "convert_notices": conversion.notices, "converted": converted.completions[0].token_ids,
    }))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
