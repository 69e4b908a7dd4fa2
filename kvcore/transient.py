"""The run's memory model: weights + compressed KV + one layer's transient, named and bounded.

A chunked prefill holds, beyond the weights and the caches' buffers, the transient of the
layer it is computing (the lazy graph of a chunk runs layer after layer, and nothing of an
earlier layer's attention outlives it):

```
attention    the call's scratch (decoded K/V), decode workspace, mask, scores, q/out
             (kvcore.attention.scratch.CallBytes, kept within AttentionConfig.scratch_bytes)
activations  the chunk's hidden states, q/k/v, MLP intermediates (chunk x per-token bytes)
update       the chunk's K/V entering the cache: its dense copy and the codec's encode
logits       (chunk, vocab) float32 where the run needs every position's (fidelity)
```
`plan_prefill` picks, for a memory budget, the largest prefill chunk (mlx-lm's 2048 at most)
whose transient fits beside the weights and the KV at the final context, and the scratch
budget the attention may use; `kvcore.cache.bytes` counts the KV side.

A lazy graph alone does not make the peak one layer's: MLX's graph walk runs ahead of the
device, and what it has handed over stays allocated until done (CUDA: up to 10 committed
command graphs keep every input alive, on an H200 up to 100 ops or 1 GB each; CPU: 10 tasks).
`memory_limit(plan)` sets MLX's memory limit to the plan's peak for the run: past it, the walk
waits for in-flight work before allocating more, so run-ahead never stacks layers' scratches. On CUDA
that wait only sees command graphs committed full, so inside the block each layer's attention also
starts from a settled graph (`kvcore.attention.settle`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from .attention import settle
from .attention.config import DEFAULT as DEFAULT_ATTENTION
from .attention.config import AttentionConfig
from .attention.prefill import default_scratch_bytes, plan_call
from .attention.scratch import CallBytes, CallShape, workspace_factor
from .backend import backend_name
from .cache.bytes import layer_shapes
from .codecs import FULL, make_codec
from .errors import MlxkvError

DEFAULT_PREFILL_CHUNK = 2048  # mlx-lm's prefill_step_size
MIN_PREFILL_CHUNK = 64
MIN_GROUP = 64  # queries per fused call below which a smaller chunk is preferred
ENCODE_WORKSPACE = {"AffineCodec": 2.0, "TurboCodec": 12.0}  # per dense input byte (float32 rotation, indices)
UNKNOWN_ENCODE = 16.0


def default_prefill_chunk() -> int:
    """The chunk a run without a memory budget uses: mlx-lm's 2048 on every device (the memory
    of a chunk is bounded by the attention budget; `plan_prefill` lowers it for a budget)."""
    return DEFAULT_PREFILL_CHUNK


@dataclass(frozen=True)
class LayerTransient:
    attention: CallBytes
    activations: int
    update: int
    logits: int = 0
    group: int = 0  # the smallest query group of a fused call over the layers (0: some layer goes blockwise)
    ahead: int = 0  # CPU: the next layer's scratch, decoded while this layer's tasks are still in flight

    @property
    def total(self) -> int:
        return self.attention.total + self.activations + self.update + self.logits + self.ahead

    def to_json(self) -> dict:
        return {"attention": self.attention.to_json(), "activations": self.activations, "update": self.update,
                "logits": self.logits, "group": self.group, "ahead": self.ahead, "total": self.total}


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def activation_bytes(config: dict, chunk: int, dtype_size: int = 2) -> int:
    """A chunk's activations in one decoder layer: the residual stream, norms and projections
    (4 x hidden), q/k/v and their RoPE copies, the attention output, the MLP's gate, up and
    product (3 x intermediate)."""
    c = _text(config)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = max(c.get("head_dim") or hidden // heads, c.get("global_head_dim") or 0)
    inter = c.get("intermediate_size") or 4 * hidden
    return chunk * dtype_size * (4 * hidden + 2 * (heads + 2 * kv) * hd + heads * hd + 3 * inter)


def _encode_factor(codec) -> float:
    return 0.0 if codec is None else ENCODE_WORKSPACE.get(type(codec).__name__, UNKNOWN_ENCODE)


def layer_transient(config: dict, policy, context: int, chunk: int, dtype_size: int = 2,
                    scratch_bytes: int | None = None, logits: bool = False) -> LayerTransient:
    """The largest layer transient of a prefill of `context` tokens in `chunk`-token chunks
    under `policy` (the last chunk: the longest past); attention planned within `scratch_bytes`
    (None: unbounded, what the call needs whole)."""
    dtype = {2: mx.bfloat16, 4: mx.float32}.get(dtype_size, mx.float16)
    c = _text(config)
    heads = c["num_attention_heads"]
    n = min(chunk, context)
    limit = scratch_bytes if scratch_bytes is not None else 1 << 62
    worst, update, group = CallBytes(), 0, n
    for i, s in enumerate(layer_shapes(config)):
        if s.kind == "other":
            continue
        key, value = policy.codec_for(i), policy.value_codec_for(i)
        kc, vc = (make_codec(x, s.head_dim) if x != FULL and x.compresses else None for x in (key, value))
        window = s.window or policy.max_kv_size
        T = min(context, window + n) if window else context
        encoded = policy.compresses and (kc or vc) and context >= (policy.start or 0)
        bt = (kc or vc).block_tokens if encoded else 1
        recent = policy.recent_for(i)
        multi = bool(window) or recent > 0 or bt > 1
        shadow = min(n + recent, T) if encoded and (recent or bt > 1) else 0  # read two ways
        factor = max(workspace_factor(kc, dtype), workspace_factor(vc, dtype)) if encoded else 0.0
        shape = CallShape(1, heads, s.kv_heads, s.head_dim, s.head_dim, n, T + shadow,
                          "array" if window or shadow else "causal",
                          in_place=not encoded and not window, segments=3 if multi else 1,
                          encoded=max(0, T - recent) if encoded else 0, factor=factor)
        plan = plan_call(shape, dtype, limit)
        call = plan.bytes if plan is not None else replace(CallBytes(), scratch=limit)  # blockwise: within limit
        group = min(group, plan.group if plan is not None else 0)
        if call.total > worst.total:
            worst = call
        dense = -(-n // 256) * 256 * s.kv_heads * 2 * s.head_dim * dtype_size  # the tail buffer's chunk
        enc = n * s.kv_heads * s.head_dim * dtype_size * (_encode_factor(kc) + _encode_factor(vc))
        update = max(update, dense + int(enc))
    vocab = c.get("vocab_size", 0)
    # MLX's CPU stream runs up to 10 tasks behind the graph walk: the next layer's decode can be
    # allocated before this layer's attention tasks have freed theirs (GPU streams free in order)
    ahead = worst.scratch + worst.workspace if backend_name() == "cpu" and group else 0
    return LayerTransient(worst, activation_bytes(config, n, dtype_size), update,
                          3 * n * vocab * 4 if logits else 0, group, ahead)


@dataclass(frozen=True)
class PrefillPlan:
    chunk: int
    attention: AttentionConfig  # scratch_bytes: what the attention call may hold
    transient: LayerTransient
    weights: int
    kv: int

    @property
    def peak(self) -> int:
        """Predicted peak: weights + KV + one layer's transient."""
        return self.weights + self.kv + self.transient.total

    def to_json(self) -> dict:
        return {"chunk": self.chunk, "scratch_bytes": self.attention.scratch_bytes, "weights": self.weights,
                "kv": self.kv, "transient": self.transient.to_json(), "peak": self.peak}


def plan_prefill(config: dict, policy, context: int, weights: int, kv: int, budget: int | None = None,
                 dtype_size: int = 2, attention: AttentionConfig = DEFAULT_ATTENTION, max_chunk: int = DEFAULT_PREFILL_CHUNK,
                 logits: bool = False) -> PrefillPlan:
    """The largest chunk (halving from `max_chunk`) and the attention budget under which a prefill
    of `context` tokens stays within `budget` bytes (None: the attention's device default)
    beside `weights` and `kv` (the caches' bytes at the final context: kvcore.cache.bytes).
    A one-line MlxkvError when not even MIN_PREFILL_CHUNK fits."""
    if budget is None:
        scratch = attention.scratch_bytes if attention.scratch_bytes is not None else default_scratch_bytes()
        n = min(max_chunk, max(context, 1))
        t = layer_transient(config, policy, context, n, dtype_size, scratch, logits)
        return PrefillPlan(n, replace(attention, scratch_bytes=scratch), t, weights, kv)
    left = budget - weights - kv
    n = min(max_chunk, max(context, 1))
    fallback = None
    while True:
        need = layer_transient(config, policy, context, n, dtype_size, None, logits)
        room = left - need.activations - need.update - need.logits - need.ahead
        if room > 0:
            t = layer_transient(config, policy, context, n, dtype_size, room, logits)
            plan = PrefillPlan(n, replace(attention, scratch_bytes=room), t, weights, kv)
            if t.group >= min(n, MIN_GROUP):  # fused calls of reasonable query groups in every layer
                return plan
            fallback = plan  # the blockwise loop (or tiny groups) at the smallest chunk that fits
        if n <= MIN_PREFILL_CHUNK:
            break
        n = max(MIN_PREFILL_CHUNK, n // 2)
    if fallback is not None:
        return fallback
    raise MlxkvError(f"a {context}-token prefill does not fit {budget / 1e9:.2f} GB: weights {weights / 1e9:.2f} GB "
                     f"+ KV {kv / 1e9:.2f} GB leave {max(left, 0) / 1e9:.3f} GB for one layer's transient")


def plan_limit(plan: PrefillPlan) -> int:
    """The memory limit a prefill under `plan` runs at: its peak, and never below what is live
    now plus its KV and transient."""
    return max(plan.peak, mx.get_active_memory() + plan.kv + plan.transient.total)


@contextmanager
def memory_limit(plan: PrefillPlan | int):
    """MLX's memory limit at `plan`'s peak (or that many bytes) inside the block, restored after:
    the graph walk waits for in-flight work whenever active memory is over it. A plan's limit is
    never below what is live now plus its KV and transient (arrays the plan does not know of, held
    by the caller, would otherwise make every step wait)."""
    limit = plan_limit(plan) if isinstance(plan, PrefillPlan) else int(plan)
    old = mx.set_memory_limit(limit)
    try:
        with settle.bounded():  # CUDA: each layer's attention starts from a settled graph (attention/settle.py)
            yield limit
    finally:
        mx.set_memory_limit(old)


def plan_for_model(model, config: dict, policy, context: int, budget: int | None = None,
                   attention: AttentionConfig = DEFAULT_ATTENTION, logits: bool = False) -> PrefillPlan:
    """`plan_prefill` for a loaded model: its weight bytes and dtype, and the KV its caches will
    allocate at `context` tokens under `policy` (kvcore.cache.bytes)."""
    from .cache.bytes import KVByteModel
    from .engine.memory import dtype_size, model_bytes
    from .policy.plan import plan_layers

    size = dtype_size(model)
    kv = KVByteModel(config, plan_layers(model, policy), size, policy.rollback or 0, mlxkv=policy.active,
                     chunk=DEFAULT_PREFILL_CHUNK).row_alloc(context)
    return plan_prefill(config, policy, context, model_bytes(model), kv, budget, size, attention, logits=logits)


@dataclass(frozen=True)
class PrefillMemory:
    """What a job knows to bound its prompts' prefill by the memory model: the model, its
    config.json and the KV policy. The engine and `generate_one` enter `bound(context)` for a
    prompt longer than one chunk, so MLX's run-ahead never holds several layers' transients."""

    model: Any
    config: dict
    policy: Any
    attention: AttentionConfig = DEFAULT_ATTENTION

    def limit(self, context: int) -> int | None:
        """The memory limit for a prefill towards `context` tokens: what is live now, plus the
        row's KV at that context and one layer's transient; None where the config does not say
        enough to plan (the prefill then runs unbounded, as before)."""
        try:
            plan = plan_for_model(self.model, self.config, self.policy, context, attention=self.attention)
        except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError, MlxkvError):
            return None
        return plan_limit(plan)

    def bound(self, context: int):
        """A context manager: `memory_limit` at `limit(context)` (nothing, where it is None)."""
        limit = self.limit(context)
        return nullcontext() if limit is None else memory_limit(limit)
