"""The one KV byte model: what a row's (or a batch's) caches cost at N tokens under a plan.

From config shapes alone (no weights loaded). `fit`, `bench`, `fidelity` and the engine's
admission all count through here, and the tests hold it against real caches' `nbytes` and
against measured memory:
- `layer_bytes` / `row_bytes`: the bytes a row's stored tokens take (what `nbytes` reports);
- `row_alloc` / `batch_alloc`: what the caches *allocate*: buffers grow in steps of
  `STEP` tokens; paged batch rows (cache/paged.py) take whole pages of their own lengths plus
  one spare page per row, packed ones (cache/packed.py, CUDA) B x (longest row + STEP) each;
- `join_transient`: the extra bytes while a row joins or leaves a batch (one layer's batch
  buffers exist twice while they are re-concatenated, or while a paged pool grows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..codecs import FULL, CodecSpec, make_codec
from .buffer import STEP
from .compressed import TRIM_STEP
from .paged import PAGE


@dataclass(frozen=True)
class LayerShape:
    kind: str  # "full-attention" | "window" | "other" (SSM state or a KV-shared layer: no KV of its own)
    window: int | None
    kv_heads: int
    head_dim: int


def layer_shapes(config: dict) -> list[LayerShape]:
    """Per layer, from config.json alone: sliding windows (Gemma), KV-shared layers (Gemma 4),
    linear-attention layers (Qwen3.5 / Qwen3-Next), global head dims (Gemma 4)."""
    c = config.get("text_config", config)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or c["hidden_size"] // heads
    window, pattern, types = c.get("sliding_window"), c.get("sliding_window_pattern"), c.get("layer_types")
    shared = c.get("num_kv_shared_layers", 0)
    interval = c.get("full_attention_interval")
    out = []
    for i in range(n):
        if i >= n - shared or (interval and (i + 1) % interval != 0):
            out.append(LayerShape("other", None, 0, 0))
            continue
        if types is not None:
            sliding = types[i] == "sliding_attention"
        else:
            sliding = bool(window and pattern and (i + 1) % pattern != 0)
        if sliding:
            out.append(LayerShape("window", window, kv, hd))
        else:
            out.append(LayerShape("full-attention", None, c.get("num_global_key_value_heads") or kv,
                                  c.get("global_head_dim") or hd))
    return out


@cache
def _codec(spec: CodecSpec, head_dim: int):
    return make_codec(spec, head_dim)


def layer_bytes(s: LayerShape, key: CodecSpec, value: CodecSpec, tokens: int, dtype_size: int = 2,
                recent: int = 0, keep: int = 0) -> int:
    """Bytes of one row's cache of layer `s` holding `tokens` tokens, as CompressedKVCache stores
    them: the `keep` sink tokens, the `recent` newest and an incomplete codec block stay dense
    (`dtype_size` bytes an element); every complete block before them costs the codecs' own
    bytes_per_token (turbo: packed indices + a float16 norm per vector; affine: packed words +
    float16 scale and bias per group)."""
    kc, vc = _codec(key, s.head_dim), _codec(value, s.head_dim)
    dense = s.kv_heads * s.head_dim * dtype_size  # one of K or V, one token
    if kc is None and vc is None:
        return tokens * 2 * dense
    block = (kc or vc).block_tokens
    encoded = max(0, tokens - min(tokens, keep) - recent) // block * block
    per_token = sum(c.bytes_per_token(s.kv_heads) if c else dense for c in (kc, vc))
    return (tokens - encoded) * 2 * dense + round(encoded * per_token)


@dataclass(frozen=True)
class LayerCost:
    """One layer of a plan, as the byte model sees it."""

    shape: LayerShape
    key: CodecSpec
    value: CodecSpec
    window: int | None  # stored-token cap (window + mlxkv's drop step and spares), None: all
    keep: int
    recent: int
    dtype_size: int
    mlxkv: bool  # an mlxkv cache (else mlx-lm's own KVCache)
    paged: bool = False  # batch rows in pages (else packed buffers)
    delayed: bool = False  # conversion starts after some tokens: rows stay apart (unpaged) until then

    @property
    def packs(self) -> bool:
        """Whether batch rows of this layer share packed buffers (cache/packed.py)."""
        if self.window is not None or self.keep or self.recent:
            return False
        kc = _codec(self.key, self.shape.head_dim)
        return kc is None or kc.block_tokens == 1

    def stored(self, tokens: int) -> int:
        return tokens if self.window is None else min(tokens, self.window)

    def used(self, tokens: int) -> int:
        return layer_bytes(self.shape, self.key, self.value, self.stored(tokens), self.dtype_size,
                           self.recent, self.keep)

    def per_token(self) -> float:
        """Bytes of one token stored the layer's steady way (encoded, or dense when full)."""
        big = 1 << 20
        return self.used(big) / big if self.window is None else layer_bytes(
            self.shape, self.key, self.value, big, self.dtype_size, 0, 0) / big

    def dense_token(self) -> int:
        return 2 * self.shape.kv_heads * self.shape.head_dim * self.dtype_size

    def row_alloc(self, tokens: int) -> int:
        """Allocated by one row: its used bytes plus one growth step of slack per buffer
        (encoded and dense buffers grow STEP tokens at a time)."""
        if self.shape.kind == "other":
            return 0
        if not self.mlxkv:
            return -(-tokens // STEP) * STEP * self.dense_token()
        slack = STEP * self.dense_token() + (round(STEP * self.per_token()) if self.key.compresses else 0)
        return self.used(tokens) + slack

    def batch_alloc(self, lengths: list[int]) -> int:
        """Allocated by these rows in one batch: packed rows take B x (longest + STEP) columns
        each; otherwise each row its own. The larger of the two (rows pack and unpack as their
        states allow)."""
        if self.shape.kind == "other" or not lengths:
            return 0
        rows = sum(self.row_alloc(n) for n in lengths)
        if len(lengths) == 1 or not (self.packs or not self.mlxkv):
            return rows
        if self.mlxkv and self.paged:  # the pool: each row's own pages and a spare one
            pages = sum(-(-(self.stored(n) + 1) // PAGE) for n in lengths) + len(lengths)
            pool = round(pages * PAGE * self.per_token())
            return max(rows, pool) if self.delayed else pool
        cap = (self.stored(max(lengths)) + STEP) // STEP * STEP
        packed = round(len(lengths) * cap * (self.per_token() if self.mlxkv else self.dense_token()))
        return max(rows, packed)


class KVByteModel:
    """The byte model of one model under one plan (`plans` from policy.plan_layers)."""

    def __init__(self, config: dict, plans: list, dtype_size: int = 2, rollback: int = 0, mlxkv: bool = True,
                 chunk: int = 1, paged: bool | None = None):
        """`chunk`: the longest update (prefill chunk); a window holds up to chunk - 1 more tokens
        while a chunk's first queries still see their whole window. `paged`: batch rows in pages
        (None: as the default attention config keeps them here)."""
        if paged is None:
            from ..attention.config import DEFAULT

            paged = DEFAULT.pages
        shapes = layer_shapes(config)
        self.layers: list[LayerCost] = []
        for i, p in enumerate(plans):
            s = shapes[i] if i < len(shapes) else LayerShape("other", None, 0, 0)
            if p.kind == "other" or s.kind == "other":
                continue
            if p.window is not None and s.window is None:  # --max-kv-size on a full-attention layer
                s = LayerShape("window", p.window, s.kv_heads, s.head_dim)
            window = p.window + (TRIM_STEP - 1 + rollback + chunk - 1 if mlxkv else 0) if p.window else None
            self.layers.append(LayerCost(s, p.codec or FULL, p.values, window, p.keep if p.window else 0,
                                         p.recent, dtype_size, mlxkv, paged, bool(p.start)))

    def row_bytes(self, tokens: int) -> int:
        """Bytes one row's stored tokens take (what its caches' nbytes report)."""
        return sum(c.used(tokens) for c in self.layers)

    def row_alloc(self, tokens: int) -> int:
        return sum(c.row_alloc(tokens) for c in self.layers)

    def batch_alloc(self, lengths: list[int]) -> int:
        return sum(c.batch_alloc(lengths) for c in self.layers)

    @property
    def paged(self) -> bool:
        return any(c.paged and c.mlxkv and c.packs for c in self.layers)

    def join_transient(self, lengths: list[int]) -> int:
        """Extra bytes while the batch's buffers are re-concatenated (a row joins or leaves):
        the largest layer's batch buffers, held twice for a moment. Paged rows are not copied: a
        joining row's own caches exist beside its pages until it is in, and a pool that grows is
        held twice for a moment, one layer at a time."""
        pool = max((c.batch_alloc(lengths) for c in self.layers), default=0)
        if self.paged:
            return pool + max((self.row_alloc(n) for n in lengths), default=0)
        return pool

    def batch_need(self, lengths: list[int]) -> int:
        """What admission reserves for rows of these final lengths: allocation + transient."""
        return self.batch_alloc(lengths) + (self.join_transient(lengths) if len(lengths) > 1 else 0)
