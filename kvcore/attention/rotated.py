"""Attention in a rotation codec's basis: no inverse rotation of the stored tokens.

A rotation codec (TurboQuant) stores R k and R v for a fixed orthogonal R, so
```
q . k          = (R q) . (R k)                 scores from the rotated keys
sum_i p_i v_i  = R^T sum_i p_i (R v_i)         one inverse rotation per query, not per token
```
When every encoded segment of a layer's view uses rotation codecs with one shared R (keys and
values of the same head dim), the query is rotated once, the stored tokens are read in the
rotated basis (dense segments - sinks, recent tokens - are rotated forward, few tokens), and
the output is rotated back. The same attention up to float rounding; the plain path
(`kv_attention` on the unrotated view) stays the reference it is tested against.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from ..cache.packed import PackedView
from ..cache.paged import PagedView
from ..cache.view import ENCODED, BatchKVView, KVView
from .config import DEFAULT


_MISS = object()


def _rotation(codec):
    return getattr(codec, "rotation", None) if hasattr(codec, "decode_rotated") else None


def _codec_rotation(key_codec, value_codec):
    """The rotation both codecs share, else None."""
    rk, rv = _rotation(key_codec), _rotation(value_codec)
    return rk if rk is not None and rk is rv else None


def _view_rotations(view: KVView) -> list:
    return [_codec_rotation(s.key_codec, s.value_codec) for s in view.segments if s.kind == ENCODED]


def shared_rotation(view):
    """The one rotation every encoded segment of `view` shares (None: attend as usual, also when
    the view's attention config turns the rotated basis off)."""
    first = view.rows[0] if isinstance(view, BatchKVView) and view.rows and view.rows[0] is not None else view
    if not getattr(first, "config", DEFAULT).rotated:
        return None
    if isinstance(view, (PackedView, PagedView)):
        return _codec_rotation(view.key_codec, view.value_codec)
    if isinstance(view, KVView):
        if view.memo is not None and view.steady:  # a decode step: the answer of the cache's codecs, kept
            rot = view.memo.get("rotation", _MISS)
            if rot is _MISS:
                seg = view.segments[0]
                rot = view.memo["rotation"] = _codec_rotation(seg.key_codec, seg.value_codec)
            return rot
        rots = _view_rotations(view)
    elif isinstance(view, BatchKVView):
        rots = [r for v in view.rows if v is not None for r in _view_rotations(v)]
    else:
        return None
    if not rots or any(r is None or r is not rots[0] for r in rots):
        return None
    return rots[0]


def rotate_view(view, rot):
    """The same view, read in `rot`'s basis."""
    if isinstance(view, (PackedView, PagedView)):
        return replace(view, rotation=rot)
    if isinstance(view, KVView):
        return replace(view, segments=[replace(s, rotation=rot) for s in view.segments])
    return replace(view, rows=[None if v is None else rotate_view(v, rot) for v in view.rows])


def in_rotated_basis(attend, q: mx.array, view, *args):
    """attend(q, view, *args), run in the view's shared rotation basis when it has one."""
    rot = shared_rotation(view)
    if rot is None:
        return attend(q, view, *args)
    out = attend(rot.forward(q).astype(q.dtype), rotate_view(view, rot), *args)
    return rot.inverse(out, q.dtype)
