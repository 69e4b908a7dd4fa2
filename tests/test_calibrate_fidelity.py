"""fidelity without --text reads the held-out sample shipped with kvcore; a scheme that cannot suit the
model's head dim gets a note."""

from typer.testing import CliRunner

from kvcore.fidelity.run import FidelityJob, heldout_texts, run_fidelity
from mlxkv_cli.main import build_app


def test_fidelity_runs_on_the_shipped_sample_with_a_note_for_unsuitable_schemes():
    assert heldout_texts() and all(t.endswith(".txt") for t in heldout_texts())
    report = run_fidelity(FidelityJob([], "affine:4,turbo:4", window_tokens=128, baselines=False)).to_json()
    assert report["texts"] == heldout_texts()
    rows = {r["scheme"]: r for r in report["rows"]}
    assert rows["affine:4/g64"]["note"] is None and rows["affine:4/g64"]["mean_kl"] < rows["turbo:4"]["mean_kl"]
    assert "turbo at head_dim 8" in rows["turbo:4"]["note"] and "2.00 bits/element" in rows["turbo:4"]["note"]


def test_fidelity_cli_without_text_prints_the_note():
    r = CliRunner().invoke(build_app(), ["fidelity", "--kv", "turbo:4", "--window-tokens", "64", "--no-baselines"])
    assert r.exit_code == 0, r.output
    assert "note: turbo:4: turbo at head_dim 8" in r.stdout
