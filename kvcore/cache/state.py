"""mlx-lm's state protocol for CompressedKVCache: arrays in `state`, everything else in `meta_state`.

```
state:      sink (k, v) | encoded key parts, value parts | tail (k, v)     (each present only if stored)
meta_state: (json of `layout()`,): specs, window, positions, counts, dims, dtype
```
Files keep K and V apart; joint storage (view.Joint) is rebuilt on load. `from_dense` makes a cache
of dense tokens not yet converted (converting a stored cache, `store/convert.py`).
"""

from __future__ import annotations

import json

import mlx.core as mx

from ..attention.config import DEFAULT as DEFAULT_ATTENTION
from ..codecs import CodecSpec
from .layout import DTYPES as _DTYPES
from .layout import dtype_name as _dtype_name


class StateProtocol:
    """The state/meta_state half of CompressedKVCache (a mixin: it reads and sets the cache's fields)."""

    @property
    def state(self) -> tuple:
        """Every stored array: sink (k, v), encoded key parts then value parts, tail (k, v)."""
        enc = tuple(a for half in self._split_enc() for a in half) if self.enc.n else ()
        return (*(self.sink.get() if self.sink.n else ()), *enc, *(self.tail.get() if self.tail.n else ()))

    # -- mlx-lm's state protocol: arrays in `state`, everything else in `meta_state` ----------
    @state.setter
    def state(self, v) -> None:
        self._loaded = tuple(v)
        if getattr(self, "_counts", None) is not None:
            self._fill()

    @property
    def meta_state(self) -> tuple[str]:
        return (json.dumps(self.layout()),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.set_layout(json.loads(v[0]))
        if getattr(self, "_loaded", None) is not None:
            self._fill()

    @classmethod
    def from_dense(cls, key_spec: CodecSpec, value_spec: CodecSpec, offset: int, dims: tuple, sink=None, rest=None,
                   window: int | None = None, keep: int = 0, recent: int = 0, stored_from: int = 0):
        """A cache holding dense tokens not yet converted: `sink` (k, v) at [0, n), `rest` (k, v) at
        [stored_from, offset), dims (B, H, D, Dv, dtype); `convert()` then encodes them."""
        c = cls(key_spec, value_spec, offset, window, keep, recent=recent)
        c._configure(dims)
        for buf, kv in ((c.sink, sink), (c.tail, rest)):
            if kv is not None:
                buf.set(tuple(kv))
        c.offset, c.enc_start, c.tail_start = offset, stored_from, stored_from
        return c

    @classmethod
    def from_state(cls, state, meta_state):
        obj = cls.__new__(cls)
        obj.meta_state = meta_state
        obj.state = state
        return obj

    def layout(self) -> dict:
        """Every field but the arrays, JSON-friendly: what `meta_state` carries."""
        dims = None if self._dims is None else list(self._dims[:4])
        return {
            "key": self.key_spec.to_json(), "value": self.value_spec.to_json(), "start": self.start,
            "window": self.window, "keep": self.keep, "offset": self.offset, "converted": self.converted,
            "enc_start": self.enc_start, "tail_start": self.tail_start,
            "sink": self.sink.n, "enc": self.enc.n, "tail": self.tail.n, "recent": self.recent,
            "key_parts": getattr(self, "_n_key_parts", None) if self.enc.n else None,
            "dims": dims, "dtype": None if self._dims is None else _dtype_name(self._dims[4]),
        }

    def set_layout(self, m: dict) -> None:
        """Reset to the (validated) layout `m`; the arrays come through `state` (before or after)."""
        spec = lambda d: CodecSpec(d["codec"], d["bits"], d["group_size"])
        loaded = getattr(self, "_loaded", None)
        attention, stats = getattr(self, "attention", DEFAULT_ATTENTION), getattr(self, "stats", None)
        self.__init__(spec(m["key"]), spec(m["value"]), m["start"] or 0, m["window"], m["keep"],
                      recent=m.get("recent", 0), attention=attention, stats=stats)
        self.offset, self.converted = m["offset"], m["converted"]
        self.enc_start, self.tail_start = m["enc_start"], m["tail_start"]
        if m["dims"] is not None:
            B, H, D, Dv = m["dims"]
            self._configure((B, H, D, Dv, _DTYPES[m["dtype"]]))
        if m["key_parts"] is not None:
            self._n_key_parts = m["key_parts"]
        self._counts, self._loaded = (m["sink"], m["enc"], m["tail"]), loaded

    def _fill(self) -> None:
        """Hand the loaded arrays (sink k, v | encoded parts | tail k, v) to the buffers."""
        (n_sink, n_enc, n_tail), parts = self._counts, self._loaded
        lo, hi = 2 if n_sink else 0, len(parts) - (2 if n_tail else 0)
        enc = parts[lo:hi]
        if self.joint and n_enc and len(enc) == 2 * self._n_key_parts:  # files keep K and V apart
            nk = self._n_key_parts
            enc = tuple(mx.concatenate([k, v], axis=1) for k, v in zip(enc[:nk], enc[nk:]))
        for buf, n, arrays in ((self.sink, n_sink, parts[:lo]), (self.enc, n_enc, enc), (self.tail, n_tail, parts[hi:])):
            if n:
                buf.set(arrays)
            if buf.n != n:
                raise ValueError(f"state holds {buf.n} entries where the layout says {n}")
        self._counts = self._loaded = None
