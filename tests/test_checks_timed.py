"""Device launches' admission checks are timed, each once, so a first prompt's cost can be named piece by
piece (kernel builds and checks: `backend.CHECKS`, which gpu_bench.py and gpu_prefill_probe.py report)."""

from __future__ import annotations

import time

from kvcore.backend import CHECKS, Verdicts, checks_since


def test_each_check_runs_once_and_is_timed_refusals_too():
    v = Verdicts("probe")
    seen, calls = len(CHECKS), []

    def slow():
        calls.append(1)
        time.sleep(0.05)
        return None

    def broken():
        raise RuntimeError("cannot build here")

    assert v.admitted(("a", 1), slow) and v.admitted(("a", 1), slow)  # the verdict is kept
    assert not v.admitted(("b", 2), broken) and "cannot build here" in v[("b", 2)]
    assert calls == [1]
    (w1, k1, s1), (w2, k2, s2) = CHECKS[seen:]
    assert (w1, k1, w2, k2) == ("probe", ("a", 1), "probe", ("b", 2)) and s1 >= 0.05 and 0 <= s2 < 0.05
    assert checks_since(seen) == [["probe", "('a', 1)", s1], ["probe", "('b', 2)", s2]]  # as the scripts report them
    assert v.admitted(("c", 3), lambda: None, "c three") and CHECKS[-1][:2] == ("probe", "c three")  # a label names it
