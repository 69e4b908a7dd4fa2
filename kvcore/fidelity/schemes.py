"""The schemes a fidelity run compares: mlxkv `--kv` values and mlx-lm's QuantizedKVCache.

`mlx-lm:affine:4/g32` is mlx-lm's own cache at 4 bits, group 32, attending through mlx-lm's
quantized attention. Each mlxkv affine scheme with equal K/V bits (and no recent window) gets
that baseline row beside it unless baselines are turned off.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..codecs import make_codec
from ..errors import MlxkvError
from ..policy import KVOptions, KVPolicy, build_caches, resolve_policy
from ..policy.kv_spec import parse_kv, split_kv_list

MLX_LM = "mlx-lm:"


@dataclass(frozen=True)
class Scheme:
    name: str  # the row label
    policy: KVPolicy | None = None  # an mlxkv scheme
    mlx_lm: tuple[int, int] | None = None  # (bits, group) of mlx-lm's QuantizedKVCache

    @property
    def engine(self) -> str:
        return "mlx-lm" if self.mlx_lm else "mlxkv"

    def caches(self, model: nn.Module) -> list:
        """Fresh caches for one window."""
        if self.mlx_lm is None:
            return build_caches(model, self.policy)[0]
        bits, group = self.mlx_lm
        template = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
        if any(type(c) is not KVCache for c in template):
            raise MlxkvError("mlx-lm's QuantizedKVCache baseline needs a model of plain KVCache layers")
        return [QuantizedKVCache(group_size=group, bits=bits) for _ in template]


def _mlx_lm(text: str) -> Scheme:
    scheme = parse_kv(text[len(MLX_LM):])
    k = scheme.key
    if k.name != "affine" or scheme.value != k or scheme.recent:
        raise MlxkvError(f"{text!r}: mlx-lm baselines are affine with equal K/V bits, e.g. mlx-lm:affine:4/g32")
    return Scheme(f"{MLX_LM}{k.label()}", mlx_lm=(k.bits, k.group_size))


def parse_schemes(text: str, baselines: bool = True) -> list[Scheme]:
    """Comma-separated `--kv` values and `mlx-lm:affine:...` rows, in order, without repeats."""
    out: list[Scheme] = []
    names = split_kv_list(text)
    if not names:
        raise MlxkvError("--kv: no schemes given (e.g. --kv full,affine:4,turbo:k4v3)")
    for name in names:
        if name.startswith(MLX_LM):
            row = _mlx_lm(name)
        else:
            policy = resolve_policy(KVOptions(kv=name, quantized_kv_start=0))
            row = Scheme(policy.label() if policy.layer_codecs is None else name, policy)
        rows = [row]
        if baselines and row.policy is not None and _has_baseline(row.policy):
            rows.append(Scheme(f"{MLX_LM}{row.policy.codec.label()}",
                               mlx_lm=(row.policy.codec.bits, row.policy.codec.group_size)))
        out += [r for r in rows if r.name not in {s.name for s in out}]
    return out


def _has_baseline(p: KVPolicy) -> bool:
    return (p.layer_codecs is None and p.codec.name == "affine" and p.value_codec is None
            and not p.recent and p.max_kv_size is None)


NOTE_BITS = 1.0  # metadata per element at which a codec cannot suit a model's head dim


def scheme_note(policy: KVPolicy | None, shapes: list) -> str | None:
    """Why a scheme cannot suit this model, if it cannot: its codec's per-vector metadata alone costs
    NOTE_BITS or more bits per element at the model's head dim (a rotation codec at head_dim 8 pays
    2 bits for its norm, where affine groups each channel over tokens for 0.5)."""
    if policy is None:
        return None
    for i, s in enumerate(shapes):
        if s.kind == "other":
            continue
        for spec in (policy.codec_for(i), policy.value_codec_for(i)):
            if not spec.compresses:
                continue
            codec = make_codec(spec, s.head_dim)
            over = 8 * codec.bytes_per_token(1) / s.head_dim - spec.bits
            if over >= NOTE_BITS:
                rot = ", and a rotation of so few dims spreads little" if hasattr(codec, "rotation") else ""
                return (f"{spec.name} at head_dim {s.head_dim}: its metadata alone costs {over:.2f} bits/element"
                        f"{rot}; it cannot suit this model")
    return None
