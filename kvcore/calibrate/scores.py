"""Sensitivity tables: every layer's predicted KL for each key codec and each value codec, per recent window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..codecs import CodecSpec
from .candidates import LayerOption
from .capture import WindowCapture
from .proxy import LayerProxy, Score

Key = tuple[CodecSpec, int]  # (codec, recent window)


@dataclass
class LayerScores:
    key: dict[Key, Score] = field(default_factory=dict)
    value: dict[Key, Score] = field(default_factory=dict)

    def cost(self, o: LayerOption, k_weight: float = 1.0, v_weight: float = 1.0) -> float:
        """Predicted KL of the layer under `o` (keys' and values' errors add); 0 at full precision."""
        if not o.compresses:
            return 0.0
        return k_weight * self.key[(o.key, o.recent)].predicted + v_weight * self.value[(o.value, o.recent)].predicted

    def to_json(self) -> dict:
        def table(d):
            return {f"{s.label()}" + (f"/r{r}" if r else ""): {"predicted_kl": v.predicted, "relative_error": v.relative}
                    for (s, r), v in d.items()}
        return {"key": table(self.key), "value": table(self.value)}


def score_window(w: WindowCapture, specs: list[CodecSpec], recents: tuple[int, ...],
                 on_layer: Callable[[int], None] | None = None) -> dict[int, LayerScores]:
    """Every (codec, recent) for keys and for values, on every captured layer of one window."""
    out = {}
    for i in sorted(w.layers):
        p = LayerProxy(w.layers[i], w.positions)
        s = LayerScores()
        for spec in specs:
            for r, d in zip(recents, p.key_errors(spec, recents)):
                s.key[(spec, r)] = p.score(d)
            for r, d in zip(recents, p.value_errors(spec, recents)):
                s.value[(spec, r)] = p.score(d)
        out[i] = s
        del p
        mx.clear_cache()
        if on_layer:
            on_layer(i)
    return out


def average(tables: list[dict[int, LayerScores]]) -> dict[int, LayerScores]:
    """Mean over windows, per layer and entry."""
    out = {}
    for i in tables[0]:
        s = LayerScores()
        for role in ("key", "value"):
            for k in getattr(tables[0][i], role):
                vals = [getattr(t[i], role)[k] for t in tables]
                getattr(s, role)[k] = Score(sum(v.predicted for v in vals) / len(vals),
                                            sum(v.relative for v in vals) / len(vals))
        out[i] = s
    return out
