"""KVPolicy (what the user asked for) -> per-layer plan -> caches for a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..attention.config import DEFAULT as DEFAULT_ATTENTION
from ..attention.config import AttentionConfig, AttentionStats
from ..attention.hook import bind
from ..cache import CompressedKVCache
from ..codecs import BITS, FULL, GROUPS, CodecSpec, codec_names, make_codec
from ..errors import MlxkvError
from .kv_spec import kv_label

MLX_LM_DEFAULT_START = 5000  # mlx-lm's quantized_kv_start default
MAX_TOKENS = 2**40  # token counts beyond this are typos (and overflow MLX's integer arguments)


@dataclass(frozen=True)
class KVPolicy:
    """Resolved once per run. `layer_codecs` (from a kv_config) overrides `codec` per layer;
    `value_codec` / `layer_value_codecs`, where given, are the values' codecs (else as the keys')."""

    codec: CodecSpec = FULL
    start: int = 0
    max_kv_size: int | None = None
    keep: int = 4
    layer_codecs: tuple[tuple[int, CodecSpec], ...] | None = None
    source: str = "flags"
    rollback: int | None = None  # speculative decoding: mlxkv caches on every layer, windows keep this many spare
    value_codec: CodecSpec | None = None
    layer_value_codecs: tuple[tuple[int, CodecSpec], ...] | None = None
    recent: int = 0  # most recent tokens kept full precision in compressed layers
    layer_recent: tuple[tuple[int, int], ...] | None = None  # per layer (a kv_config's "recent"), else `recent`

    def __post_init__(self):
        if self.codec.compresses:
            if self.codec.name not in codec_names():
                raise MlxkvError(f"unknown KV codec {self.codec.name!r}")
            if self.codec.name == "affine" and self.codec.bits not in BITS:
                raise MlxkvError(f"--kv-bits must be one of {list(BITS)}, got {self.codec.bits}")
            if self.codec.name == "affine" and self.codec.group_size not in GROUPS:
                raise MlxkvError(f"--kv-group-size must be one of {list(GROUPS)}, got {self.codec.group_size}")
        for spec in {self.codec, self.value_codec or FULL, *dict(self.layer_value_codecs or ()).values()}:
            _check_spec(spec)
        for r in (self.recent, *dict(self.layer_recent or ()).values()):
            if r < 0:
                raise MlxkvError(f"recent tokens must be >= 0, got {r}")
        if self.start < 0:
            raise MlxkvError(f"--quantized-kv-start must be >= 0, got {self.start}")
        if self.keep < 0:
            raise MlxkvError(f"--kv-keep must be >= 0, got {self.keep}")
        for name, n in (("--quantized-kv-start", self.start), ("--max-kv-size", self.max_kv_size),
                        ("--kv-keep", self.keep), ("recent tokens", self.recent)):
            if n is not None and n > MAX_TOKENS:
                raise MlxkvError(f"{name} {n} is beyond any context (at most {MAX_TOKENS} tokens)")
        if self.max_kv_size is not None and self.max_kv_size <= self.keep:
            raise MlxkvError(f"--max-kv-size ({self.max_kv_size}) must be larger than keep ({self.keep})")

    @property
    def compresses(self) -> bool:
        return self.codec.compresses or (self.value_codec or FULL).compresses or bool(self.layer_codecs)

    @property
    def active(self) -> bool:
        """Whether mlxkv caches are needed at all (else mlx-lm's own caches are used)."""
        return self.compresses or self.max_kv_size is not None or self.rollback is not None

    def codec_for(self, layer: int) -> CodecSpec:
        if self.layer_codecs is not None:
            return dict(self.layer_codecs).get(layer, FULL)
        return self.codec

    def value_codec_for(self, layer: int) -> CodecSpec:
        if self.layer_codecs is not None:
            return dict(self.layer_value_codecs or ()).get(layer, self.codec_for(layer))
        return self.value_codec or self.codec

    def recent_for(self, layer: int) -> int:
        """Newest tokens layer `layer` keeps full precision (when it compresses)."""
        return dict(self.layer_recent or ()).get(layer, self.recent)

    def label(self) -> str:
        """The `--kv` value this policy stands for (`per-layer` for a kv_config)."""
        if self.layer_codecs is not None:
            return "per-layer"
        return kv_label(self.codec, self.value_codec or self.codec) + (f"/r{self.recent}" if self.recent else "")


def _check_spec(spec: CodecSpec) -> None:
    """A codec that cannot be built from `spec` (bad bits or group) is a one-line error."""
    if not spec.compresses:
        return
    try:
        make_codec(spec, 64)
    except ValueError as e:
        raise MlxkvError(str(e)) from None


@dataclass(frozen=True)
class LayerPlan:
    index: int
    kind: str  # "full-attention" | "window" | "other" (SSM state etc.: never compressed)
    codec: CodecSpec = field(default=FULL)
    start: int | None = None
    window: int | None = None
    keep: int = 0
    value_codec: CodecSpec | None = None  # None: as `codec`
    recent: int = 0

    @property
    def values(self) -> CodecSpec:
        return self.value_codec or self.codec

    @property
    def compresses(self) -> bool:
        return self.codec.compresses or self.values.compresses

    def label(self) -> str:
        return kv_label(self.codec, self.values) + (f"/r{self.recent}" if self.recent else "")

    def to_json(self) -> dict:
        return {"layer": self.index, "kind": self.kind, **self.codec.to_json(),
                "start": self.start, "window": self.window, "keep": self.keep,
                "value": self.values.to_json(), "recent": self.recent}


def _template(model: nn.Module) -> list:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _kv_shared(model: nn.Module) -> bool:
    """Whether the model's last layers reuse earlier layers' K/V (Gemma 4's num_kv_shared_layers)."""
    args = getattr(getattr(model, "language_model", model), "args", None)
    return bool(getattr(args, "num_kv_shared_layers", 0))


def plan_layers(model: nn.Module, policy: KVPolicy) -> list[LayerPlan]:
    template = _template(model)
    n_layers = len(getattr(model, "layers", template))
    if policy.layer_codecs is not None:
        # KV-sharing models (Gemma 4) own caches for their first layers only; the rest read a
        # donor's cache, so layer_idx equals the cache position for every cache-owning layer.
        shared = n_layers - len(template) if _kv_shared(model) else 0
        if len(template) + shared != n_layers:
            raise MlxkvError(
                f"kv_config layer_idx cannot be mapped: the model has {n_layers} layers "
                f"but {len(template)} caches"
            )
        for idx, _ in policy.layer_codecs:
            if len(template) <= idx < n_layers:
                raise MlxkvError(
                    f"kv_config: layer_idx {idx} is a KV-shared layer (it owns no cache; it reads an "
                    f"earlier layer's): compress its donor instead"
                )
            if idx >= len(template):
                raise MlxkvError(f"kv_config: layer_idx {idx} out of range (model has {n_layers} layers)")
            if type(template[idx]) not in (KVCache, RotatingKVCache):
                raise MlxkvError(
                    f"kv_config: layer_idx {idx} is a {type(template[idx]).__name__} layer, not attention"
                )
    plans = []
    for i, c in enumerate(template):
        if type(c) is RotatingKVCache:
            kind, window, keep = "window", c.max_size, c.keep
        elif type(c) is KVCache:
            kind, window, keep = "full-attention", None, 0
            if policy.max_kv_size is not None:
                kind, window, keep = "window", policy.max_kv_size, policy.keep
        else:
            plans.append(LayerPlan(i, "other"))
            continue
        codec, values = policy.codec_for(i), policy.value_codec_for(i)
        on = codec.compresses or values.compresses
        plans.append(LayerPlan(i, kind, codec, policy.start if on else None, window, keep,
                               values if values != codec else None, policy.recent_for(i) if on else 0))
    return plans


def build_caches(model: nn.Module, policy: KVPolicy, attention: AttentionConfig = DEFAULT_ATTENTION,
                 stats: AttentionStats | None = None) -> tuple[list, list[LayerPlan]]:
    """The model's cache list under `policy`, and the per-layer plan it follows.

    With nothing to compress and no window, mlx-lm's own caches are returned unchanged (the model is bound all
    the same: the engine's batch rows of those caches decode through `attention.dense_fold` where it runs).
    Otherwise every attention layer gets a CompressedKVCache (full-precision layers too), so
    masks and layouts agree across layers of one kind. With `policy.rollback` set (speculative
    decoding), mlxkv caches are used even when nothing is compressed (rollback is row-local)
    and windows keep that many spare tokens, so rollback after several updates stays possible.
    The mlxkv caches share one `AttentionStats` (`stats`, or a new one) and carry `attention`; the model is bound to
    kvcore's attention (a model that cannot attend through it is a one-line error).
    """
    template = _template(model)
    plans = plan_layers(model, policy)
    if not policy.active:
        bind(model, required=False)  # dense batch rows' decode folds its query heads there (attention/dense_fold.py)
        return template, plans
    bind(model)
    stats = stats if stats is not None else AttentionStats()
    caches = []
    for c, p in zip(template, plans):
        if p.kind == "other":
            caches.append(c)
        else:
            caches.append(CompressedKVCache(p.codec, p.value_codec, start=p.start or 0, window=p.window, keep=p.keep,
                                            spare=policy.rollback or 0, recent=p.recent, attention=attention,
                                            stats=stats))
    return caches, plans
