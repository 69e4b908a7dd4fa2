"""scripts/ncu_stalls.py reads ncu's source page: the instructions waited on most, and the load behind a
long-scoreboard wait."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_stalls.py"


def test_the_most_waited_on_instruction_names_its_load(tmp_path):
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_barrier",
           "stall_long_sb (Not Issued)"]
    rows = [["0x0", "LDG.E R38, desc[UR6][R22.64]", "1", "0", "0", "0"],
            ["0x10", "LDG.E.128 R8, desc[UR6][R120.64]", "0", "0", "0", "0"],
            ["0x20", "FMUL R38, R38, 1.4426950216293334961", "60", "58", "2", "0"],
            ["0x30", "BAR.SYNC 0x0", "30", "0", "30", "0"],
            ["0x40", "SHF.R.U32.HI R7, RZ, 0x4, R8", "9", "9", "0", "0"]]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "mlxkv_decode"])
        w.writerow(hdr)
        w.writerows(rows)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--top", "3"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("5 instructions, 100 stall samples; by reason: long_sb 67%, barrier 32%")
    assert "60.0%" in out[1] and "FMUL" in out[1] and "<- LDG.E R38" in out[1]
    assert "30.0%" in out[2] and "barrier" in out[2] and "<-" not in out[2]
    assert "9.0%" in out[3] and "<- LDG.E.128 R8" in out[3]


def test_a_file_without_the_source_page_is_a_one_line_error(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Metric Name"\n"0","Duration"\n')
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Warp Stall Sampling" in r.stderr
