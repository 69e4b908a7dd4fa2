"""Choose one option per layer: least predicted KL whose bytes stay within the budget.

A multiple-choice knapsack. Each layer's options are first cut to their Pareto front (no option
both larger and worse than another); a dynamic programme over bytes rounded *up* to
`budget / RESOLUTION` units then finds the best set (so the true bytes never exceed the
budget), and the bytes the rounding left over are spent greedily, best KL drop per byte first,
on exact byte counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import MlxkvError
from ..units import format_bytes

RESOLUTION = 4000


@dataclass(frozen=True)
class Item:
    cost: float  # predicted KL (additive over layers)
    nbytes: int
    key: object  # what the caller chose (a LayerOption)


def pareto(items: list[Item]) -> list[Item]:
    """Items sorted by bytes, each strictly better (lower cost) than every smaller one."""
    out: list[Item] = []
    for it in sorted(items, key=lambda i: (i.nbytes, i.cost)):
        if not out or it.cost < out[-1].cost:
            out.append(it)
    return out


def solve(layers: list[list[Item]], budget: int) -> list[Item]:
    """One item per layer, minimising the summed cost with summed bytes <= budget."""
    fronts = [pareto(items) for items in layers]
    smallest = sum(f[0].nbytes for f in fronts)
    if smallest > budget:
        raise MlxkvError(f"the budget ({format_bytes(budget)} of KV per row) is below the smallest "
                         f"candidate config ({format_bytes(smallest)}): raise it or add narrower candidates")
    unit = max(1, math.ceil(budget / RESOLUTION))
    cap = budget // unit
    dp = np.zeros(cap + 1)  # least cost with at most c units, over the layers so far
    picks = []
    for front in fronts:
        new = np.full(cap + 1, np.inf)
        arg = np.zeros(cap + 1, dtype=np.int64)
        for n, it in enumerate(front):
            w = -(-it.nbytes // unit)
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = dp[: cap + 1 - w] + it.cost
            better = cand < new
            new[better], arg[better] = cand[better], n
        dp = new
        picks.append(arg)
    if not np.isfinite(dp[cap]):  # rounding up left no room: take the smallest of each
        chosen = [0] * len(fronts)
    else:
        chosen, c = [], cap
        for front, arg in zip(reversed(fronts), reversed(picks)):
            n = int(arg[c])
            chosen.append(n)
            c -= -(-front[n].nbytes // unit)
        chosen.reverse()
    return _spend_rest(fronts, chosen, budget)


def _spend_rest(fronts: list[list[Item]], chosen: list[int], budget: int) -> list[Item]:
    """Upgrade layers while the exact bytes allow, the largest KL drop per extra byte first."""
    while True:
        used = sum(f[n].nbytes for f, n in zip(fronts, chosen))
        best, gain = None, 0.0
        for layer, (front, n) in enumerate(zip(fronts, chosen)):
            for m in range(n + 1, len(front)):
                extra = front[m].nbytes - front[n].nbytes
                drop = front[n].cost - front[m].cost
                if used + extra <= budget and drop / max(extra, 1) > gain:
                    best, gain = (layer, m), drop / max(extra, 1)
        if best is None:
            return [f[n] for f, n in zip(fronts, chosen)]
        chosen[best[0]] = best[1]
