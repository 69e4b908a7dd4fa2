"""Per-row LoRA adapters in one batch: a gathered LoRA layer (measured against grouping the rows
by adapter between steps: BENCHMARKS.md, scripts/bench_adapters.py).

Every linear layer an adapter targets becomes a `GatheredLoRA`: the base layer and each adapter's
A (in, r) and B (r, out), stacked and zero-padded to the largest rank (index 0: no adapter):

    y[b] = linear(x[b]) + scale[i_b] * (x[b] @ A[i_b]) @ B[i_b]        i_b: row b's adapter

`select(indices)` sets the rows' adapters before a forward (a graph keeps the indices it was
built with). When every row has the same adapter the layer computes exactly mlx-lm's LoRALinear
(or the bare layer for none), so a row alone gives what `--adapter-path` gives; mixed rows go
through `mx.gather_mm` (no copy of the gathered matrices).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .adapters import CONFIG, WEIGHTS, apply_adapter, check_adapter_folder
from .errors import MlxkvError


class Selection:
    """The rows' adapters for the next forward: None (no adapter), one index for every row, or (B,)."""

    rows: int | mx.array | None = None


class GatheredLoRA(nn.Module):
    def __init__(self, linear: nn.Module, adapters: list[tuple[mx.array, mx.array, float] | None],
                 selection: Selection):
        super().__init__()
        self.linear = linear
        present = [a for a in adapters if a is not None]
        r = max(a.shape[1] for a, _, _ in present)
        n_in, n_out, dtype = present[0][0].shape[0], present[0][1].shape[1], present[0][0].dtype
        zero_a, zero_b = mx.zeros((n_in, r), dtype), mx.zeros((r, n_out), dtype)

        def pad(m, rows: bool):
            extra = r - m.shape[0 if rows else 1]
            return m if not extra else mx.pad(m, [(0, extra), (0, 0)] if rows else [(0, 0), (0, extra)])
        self.lora_a = mx.stack([zero_a if a is None else pad(a[0], False) for a in adapters])  # (n, in, r)
        self.lora_b = mx.stack([zero_b if a is None else pad(a[1], True) for a in adapters])  # (n, r, out)
        self._scales = [0.0 if a is None else float(a[2]) for a in adapters]
        self._ranks = [0 if a is None else a[0].shape[1] for a in adapters]
        self._scale = mx.array(self._scales, mx.float32)
        self._sel = selection

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        sel = self._sel.rows
        if sel is None:
            return y
        if isinstance(sel, int):  # one adapter for every row: mlx-lm's LoRALinear, exactly
            r = self._ranks[sel]
            if not r:
                return y
            z = (x @ self.lora_a[sel, :, :r]) @ self.lora_b[sel, :r, :]
            return y + (self._scales[sel] * z).astype(x.dtype)
        # x (B, L, in), sel (B,): row b through adapter sel[b]
        z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=sel), self.lora_b, rhs_indices=sel)
        s = self._scale[sel].astype(z.dtype).reshape((-1,) + (1,) * (z.ndim - 1))
        return y + (s * z).astype(x.dtype)


def _dims(layer: nn.Module) -> tuple[int, int] | None:
    """(inputs, outputs) of a linear layer, or None for anything else."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[1] * 32 // layer.bits, layer.weight.shape[0]
    if isinstance(layer, nn.Linear):
        return layer.weight.shape[1], layer.weight.shape[0]
    return None


def read_lora(path: str | Path, modules: dict, what: str) -> dict[str, tuple[mx.array, mx.array, float]]:
    """An adapter folder's LoRA matrices per module path, checked against the model's `modules`."""
    p = check_adapter_folder(path, what)
    cfg = json.loads((p / CONFIG).read_text())
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise MlxkvError(f"{what} {p}: per-row adapters are LoRA only, this one is {kind!r} "
                         "(give it with --adapter-path for the whole run)")
    try:
        scale = float(cfg["lora_parameters"]["scale"])
    except (TypeError, ValueError):
        raise MlxkvError(f"{what} {p}: lora_parameters.scale must be a number") from None
    try:
        weights = mx.load(str(p / WEIGHTS))
    except (RuntimeError, ValueError, OSError) as e:  # a truncated or foreign file
        raise MlxkvError(f"{what} {p}: {WEIGHTS} does not load ({type(e).__name__})") from None
    pairs, errors = {}, []
    for name, w in weights.items():
        path_, _, leaf = name.rpartition(".")
        dims = _dims(modules.get(path_))
        if leaf not in ("lora_a", "lora_b"):
            errors.append(f"{name} is not a LoRA matrix")
        elif dims is None:
            errors.append(f"{path_} is not a linear layer of this model")
        elif w.ndim != 2 or (leaf == "lora_a" and w.shape[0] != dims[0]) or (leaf == "lora_b" and w.shape[1] != dims[1]):
            errors.append(f"{name} has shape {tuple(w.shape)}, the layer maps {dims[0]} -> {dims[1]}")
        else:
            pairs.setdefault(path_, {})[leaf] = w
    for path_, ab in pairs.items():
        if len(ab) == 2 and ab["lora_a"].shape[1] != ab["lora_b"].shape[0]:
            errors.append(f"{path_}: lora_a and lora_b ranks differ")
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise MlxkvError(f"{what} {p} does not fit this model: {errors[0]}{more}")
    # a module with only one of the two matrices adds nothing (mlx-lm's B starts at zero)
    return {k: (ab["lora_a"], ab["lora_b"], scale) for k, ab in pairs.items() if len(ab) == 2}


class AdapterSet:
    """Several LoRA adapters installed in one model; index 0 is no adapter, i the i-th folder.
    Rows without an adapter of their own get `default` (the run's --adapter-path), if any."""

    def __init__(self, model: nn.Module, paths: list[str | Path], default: str | Path | None = None):
        given = ([default] if default else []) + list(paths)
        self.paths = list(dict.fromkeys(str(Path(p).resolve()) for p in given))
        self._known: dict = {}
        self.default = self.index(default) if default else 0
        modules = dict(model.named_modules())
        # errors name the folder as it was given: the run's --adapter-path, or a row's "adapter"
        shown = {str(Path(p).resolve()): (p, "--adapter-path" if i == 0 and default else "adapter")
                 for i, p in reversed(list(enumerate(given)))}
        loaded = [read_lora(shown[f][0], modules, shown[f][1]) for f in self.paths]
        self.selection = Selection()
        targets = sorted(set().union(*loaded))
        layers = [(t, GatheredLoRA(modules[t], [None] + [a.get(t) for a in loaded], self.selection)) for t in targets]
        if layers:
            model.update_modules(tree_unflatten(layers))
        model._kv_adapters = self  # the Runner finds it here (adapter_set)

    def index(self, path: str | Path | None) -> int:
        if path is None:
            return self.default
        if path not in self._known:  # resolved once per name, not every step
            key = str(Path(path).resolve())
            if key not in self.paths:
                raise MlxkvError(f"adapter {path} was not installed in this model's adapter set")
            self._known[path] = self.paths.index(key) + 1
        return self._known[path]

    def select(self, indices: list[int]) -> None:
        """The rows' adapter indices for the next forward (one host list -> one small array)."""
        if indices and all(i == indices[0] for i in indices):
            self.selection.rows = indices[0] or None
        else:
            self.selection.rows = mx.array(indices, mx.uint32) if indices else None


def adapter_set(model: nn.Module) -> AdapterSet | None:
    """The per-row adapter set installed in `model`, if any."""
    return getattr(model, "_kv_adapters", None)


def select_rows(model: nn.Module, requests: list) -> None:
    """The next forward's rows (Requests, in batch order), each through its adapter."""
    aset = adapter_set(model)
    if aset is not None:
        aset.select([aset.index(r.adapter) for r in requests])
    elif any(r.adapter for r in requests):
        raise MlxkvError(f"row {next(r.id for r in requests if r.adapter)} names an adapter, but the model has "
                         "no per-row adapters installed (kvcore.adapter_set.AdapterSet)")


def install_adapters(model: nn.Module, default: str | Path | None, rows: list[str | None]) -> AdapterSet | None:
    """The run's adapters: --adapter-path alone is mlx-lm's LoRA layers for every row; rows that
    name their own (a prompts file's "adapter") get a gathered set, `default` for the others."""
    named = [r for r in rows if r]
    if not named:
        if default:
            apply_adapter(model, default)
        return None
    return AdapterSet(model, named, default)
