"""scripts/ncu_step_summary.py: a whole step's device time by kernel from ncu's CSV, per step."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_step_summary.py"


def test_kernels_are_summed_per_step_largest_first_in_one_unit(tmp_path):
    hdr = ["ID", "Process ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"]
    launches = [("gemv", "usecond", "130.5"), ("mlxkv_decode", "nsecond", "36,200"), ("gemv", "usecond", "129.5"),
                ("mlxkv_decode", "usecond", "35.8"), ("rms_norm", "nsecond", "4,000")]
    path = tmp_path / "step.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f)
        w.writerow(hdr)
        for i, (name, unit, value) in enumerate(launches):
            w.writerow([str(i), "1", name, "gpu__time_duration.sum", unit, value])
            w.writerow([str(i), "1", name, "launch__grid_size", "", "520"])  # other metrics are not times
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--steps", "2", "--label", "x"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "## x:     168.0 us per step, 2.5 launches"
    assert [line.split()[-1] for line in out[1:]] == ["gemv", "mlxkv_decode", "rms_norm"]
    assert out[1].split()[:3] == ["1.0", "launches", "130.0"] and out[2].split()[2] == "36.0"


def test_a_capture_without_kernels_says_so(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== Disconnected\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--steps", "1"], capture_output=True, text=True,
                         check=True).stdout
    assert "no kernels captured" in out
