"""Per-layer KV codecs and bits under a budget (`mlxkv calibrate`).

Sensitivities come from captured Q/K/V and output gradients (`capture.py`, `proxy.py`), a
knapsack chooses under the budget (`solve.py`, bytes from the one byte model), end-to-end
checks through the real caches confirm (`check.py`), and the choice is written as an optiq-style
kv_config (`config_file.py`).
"""

__all__ = ["Budget", "CalibrateJob", "Calibration", "CandidateSet", "LayerOption", "config_entries", "config_policy",
           "config_text", "parse_candidates", "run_calibrate"]

from ..lazy import exports  # noqa: E402

__getattr__ = exports(__name__, {
    "Budget": "budget",
    "CandidateSet": "candidates", "LayerOption": "candidates", "parse_candidates": "candidates",
    "config_entries": "config_file", "config_policy": "config_file", "config_text": "config_file",
    "CalibrateJob": "run", "Calibration": "run", "run_calibrate": "run",
})
