"""Per-layer KV codecs and bits under a budget (`mlxkv calibrate`).

Sensitivities come from captured Q/K/V and output gradients (`capture.py`, `proxy.py`), a
knapsack chooses under the budget (`solve.py`, bytes from the one byte model), end-to-end
checks through the real caches confirm (`check.py`), and the choice is written as an optiq-style
kv_config (`config_file.py`).
"""

from .budget import Budget
from .candidates import CandidateSet, LayerOption, parse_candidates
from .config_file import config_entries, config_policy, config_text
from .run import CalibrateJob, Calibration, run_calibrate

__all__ = ["Budget", "CalibrateJob", "Calibration", "CandidateSet", "LayerOption", "config_entries", "config_policy",
           "config_text", "parse_candidates", "run_calibrate"]
