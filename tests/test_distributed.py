"""Two ranks on localhost with MLX's ring backend (tensor parallel), launched by mlx.launch."""

import json

from dist_helpers import MLXKV, launch, needs_launch, single, tokens

pytestmark = needs_launch


def test_two_ranks_match_one_process(tiny_models, tmp_path):
    """Bits off and 4-bit KV, two rows each: rank 0's tokens equal a single process's."""
    model = str(tiny_models("llama"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time there was", "id": "a"}\n{"prompt": "The dog ran", "id": "b"}\n')
    runs = [["generate", "-m", model, "--prompts-file", str(prompts), "-n", "12", "--json", *kv]
            for kv in ([], ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"])]
    r = launch(" ; [ \"$MLX_RANK\" = 0 ] && echo ===; ".join(" ".join([MLXKV, *args]) for args in runs), 35100)
    parts = r.stdout.split("===\n")
    assert len(parts) == 2, r.stderr[-2000:]
    for args, out in zip(runs, parts):
        one = single(args)
        assert one.returncode == 0, one.stderr
        assert tokens(out) == tokens(one.stdout) and len(tokens(one.stdout)) == 2  # rank 0 printed once
        summary = json.loads(out.splitlines()[-1])
        # each rank keeps half of the KV heads
        assert summary["ranks"] == 2 and summary["kv_bytes"] * 2 == json.loads(one.stdout.splitlines()[-1])["kv_bytes"]


def test_bench_json_from_rank_zero_only(tiny_models):
    r = launch(f"{MLXKV} bench -m {tiny_models('llama')} --kv full,affine:8 --context 16 --gen 3 --repeats 1 "
               "--no-baseline --json", 35140)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(reports) == 1 and reports[0]["meta"]["ranks"] == 2 and len(reports[0]["rows"]) == 2


def test_a_rank_missing_the_model_stops_every_rank(tiny_models):
    model = tiny_models("llama")
    r = launch(f'if [ "$MLX_RANK" = 1 ]; then M=/no/such/model; else M={model}; fi; {MLXKV} generate -m $M x -n 2',
               35160, timeout=90)
    # mlx.launch itself exits 0 whatever its ranks do; it reports each rank's exit code
    assert "exited with code 1" in r.stderr
    assert "model not found: /no/such/model" in r.stderr and "rank 1 failed during setup" in r.stderr
    assert "Traceback" not in r.stderr


def test_mismatched_settings_are_refused(tiny_models):
    model = tiny_models("llama")
    r = launch(f'B=8; [ "$MLX_RANK" = 1 ] && B=4; {MLXKV} generate -m {model} x -n 2 --kv-bits $B', 35180, timeout=90)
    assert "exited with code 1" in r.stderr
    assert "runs different settings than rank 0" in r.stderr and "Traceback" not in r.stderr
