"""Capture what each attention layer sees on a window, and how the loss responds to its output.

One full-precision forward pass records every attention call's queries, keys and values (after
RoPE) and the reference log-probabilities. Then, for S next-token sequences y_s drawn from the
reference distribution, one backward pass each gives g_s = d sum_t log p_t(y_s,t) / d o_l, the
gradient with respect to every layer's attention output o_l. Because E_y[g] = 0, for a small
change d of the attention outputs the teacher-forced KL to the reference is, to second order,
```
sum_t KL_t  ~  1/2 E_y[(g . d)^2]     (the Fisher information of the output distribution)
```
which `proxy.py` evaluates per layer, codec and K/V. Attention calls are routed through a
wrapper around whatever `scaled_dot_product_attention` the model's modules hold (mlx-lm's, or
kvcore's hook), restored afterwards; the cache object a call receives names its layer.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import MlxkvError


@dataclass
class LayerCapture:
    index: int  # the layer's position in the model's cache list (kv_config layer_idx)
    q: mx.array  # (Hq, T, D) float32, after RoPE
    k: mx.array  # (Hkv, T, D)
    v: mx.array  # (Hkv, T, Dv)
    scale: float
    visible: mx.array | None  # (T, T) bool where the model's mask is not plain causal (windows)
    grads: mx.array | None = None  # (S, Hq, P, Dv): d loss_s / d output at the sampled query positions


@dataclass
class WindowCapture:
    tokens: list[int]
    logprobs: mx.array  # (T, vocab) float32 reference log-probabilities
    positions: mx.array  # (P,) query positions the gradients (and the proxy) are taken at
    layers: dict[int, LayerCapture] = field(default_factory=dict)


@contextmanager
def routed_attention(model: nn.Module, wrapper: Callable):
    """While the block runs, the model's attention calls go to `wrapper(original, q, k, v, cache, scale,
    mask, sinks)`; the modules' own binding is restored on exit."""
    names = sorted({type(m).__module__ for _, m in model.named_modules()})
    saved = {}
    for n in names:
        mod = sys.modules.get(n)
        fn = getattr(mod, "scaled_dot_product_attention", None) if mod is not None else None
        if callable(fn):
            saved[n] = fn
            setattr(mod, "scaled_dot_product_attention", partial(_call, wrapper, fn))
    if not saved:
        raise MlxkvError(f"model class {type(model).__module__} does not attend through "
                         "mlx_lm.models.base.scaled_dot_product_attention; calibrate cannot observe it")
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(sys.modules[n], "scaled_dot_product_attention", fn)


def _call(wrapper, original, queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    return wrapper(original, queries, keys, values, cache, scale, mask, sinks)


def attention_caches(model: nn.Module) -> list:
    """mlx-lm's own caches for the model (full precision), one per cache-owning layer."""
    return model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]


def _visible(mask, T: int) -> mx.array | None:
    if mask is None or isinstance(mask, str):
        return None
    m = mask.reshape(-1, *mask.shape[-2:])[0]
    if m.shape != (T, T):
        raise MlxkvError(f"calibrate: attention mask of shape {tuple(mask.shape)} for {T} tokens is not supported")
    return m if m.dtype == mx.bool_ else m > -1e9


def capture_window(model: nn.Module, tokens: list[int], positions: mx.array, samples: int, seed: int) -> WindowCapture:
    """Queries, keys, values and output gradients of every plain attention layer on `tokens`."""
    caches = attention_caches(model)
    index = {id(c): i for i, c in enumerate(caches) if type(c) in (KVCache, RotatingKVCache)}
    T = len(tokens)
    layers: dict[int, LayerCapture] = {}

    def record(original, q, k, v, cache, scale, mask, sinks):
        if sinks is not None:
            raise MlxkvError("calibrate: attention with sinks is not supported yet")
        i = index.get(id(cache))
        if i is not None and i not in layers and k.shape[2] == T and q.shape[0] == 1:
            f32 = lambda a: a[0].astype(mx.float32)  # noqa: E731
            layers[i] = LayerCapture(i, f32(q), f32(k), f32(v), float(scale), _visible(mask, T))
        return original(q, k, v, cache, scale=scale, mask=mask, sinks=sinks)

    ids = mx.array(tokens)[None]
    with routed_attention(model, record):
        logits = model(ids, cache=caches)[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(lp, *[a for c in layers.values() for a in (c.q, c.k, c.v)])
    if not layers:
        raise MlxkvError("calibrate: the model has no attention layer with a plain KV cache to calibrate")
    out = WindowCapture(tokens, lp, positions, layers)
    if samples:
        _gradients(model, out, samples, seed)
    return out


def _gradients(model: nn.Module, w: WindowCapture, samples: int, seed: int) -> None:
    """g_s for `samples` token sequences drawn from the reference, at the sampled positions."""
    ids = mx.array(w.tokens)[None]
    T = len(w.tokens)
    order = sorted(w.layers)
    keys = mx.random.split(mx.random.key(seed), samples)
    grads: dict[int, list] = {i: [] for i in order}
    for s in range(samples):
        y = mx.random.categorical(w.logprobs[:-1], key=keys[s])  # (T-1,)

        def loss(probes):
            caches = attention_caches(model)
            index = {id(c): i for i, c in enumerate(caches)}

            def add(original, q, k, v, cache, scale, mask, sinks):
                o = original(q, k, v, cache, scale=scale, mask=mask, sinks=sinks)
                i = index.get(id(cache))
                return o + probes[order.index(i)].astype(o.dtype) if i in w.layers else o

            with routed_attention(model, add):
                logits = model(ids, cache=caches)[0].astype(mx.float32)
            lp = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
            return mx.take_along_axis(lp, y[:, None], axis=-1).sum()

        probes = [mx.zeros((1, c.q.shape[0], T, c.v.shape[-1]), dtype=mx.float32)
                  for c in (w.layers[i] for i in order)]
        g = mx.grad(loss)(probes)
        for i, gi in zip(order, g):
            grads[i].append(gi[0][:, w.positions])
        mx.eval([grads[i][-1] for i in order])
    for i in order:
        w.layers[i].grads = mx.stack(grads[i])  # (S, Hq, P, Dv)
