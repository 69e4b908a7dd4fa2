"""CompressedKVCache: full-attention or sliding-window KV storage through a codec.

Tokens are stored dense until `start`, then converted: complete blocks go through the
codec, the incomplete last block (token-layout codecs only) stays dense until it fills.
A sliding window keeps the first `keep` tokens (dense: the attention sink) and the last
`window - keep`; older ones are dropped in steps of `TRIM_STEP` tokens so that rollback
(`trim`) stays possible and every codec's blocks are dropped whole. A window built with
`spare` = s keeps s more tokens, so that s + 1 tokens can always be rolled back after any
update (speculative decoding trims after several single-token updates). With `recent` = r,
the r newest tokens stay dense too: a token is read encoded only by queries more than r
positions after it (KIVI's full-precision residual).

Honours mlx-lm's cache protocol (`update_and_fetch`, `offset`, `make_mask`, `trim`, ...);
`update_and_fetch` returns a `KVView` that `kvcore.attention` reads.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..attention import cuda_encode
from ..attention.config import DEFAULT as DEFAULT_ATTENTION
from ..attention.config import AttentionConfig, AttentionStats
from ..backend import backend_name
from ..codecs import CodecSpec, make_codec
from . import rollback
from .buffer import STEP, Buffer
from .layout import Layout
from .state import StateProtocol
from .view import DENSE, ENCODED, SHADOW, Joint, KVView, Segment

TRIM_STEP = 128  # a multiple of every block size, so dropping never splits a block
JOINT_CONCAT_TOKENS = 16  # joint storage: runs up to this many tokens are encoded in one call
CONVERT_PIECE = 4096  # tokens encoded per call when a layer's stored tokens are converted at once

class CompressedKVCache(StateProtocol, _BaseCache):
    def __init__(
        self,
        key_spec: CodecSpec,
        value_spec: CodecSpec | None = None,
        start: int = 0,
        window: int | None = None,
        keep: int = 0,
        spare: int = 0,
        recent: int = 0,
        attention: AttentionConfig = DEFAULT_ATTENTION,
        stats: AttentionStats | None = None,
    ):
        from ..attention.hook import install

        install()  # models attend through kvcore whenever they are handed these caches
        if window is not None and keep >= window:
            raise ValueError(f"keep ({keep}) must be smaller than the window ({window})")
        self.key_spec = key_spec
        self.value_spec = value_spec or key_spec
        self.start = start if key_spec.compresses or self.value_spec.compresses else None
        self.window = window
        self.keep = keep if window is not None else 0
        self.spare = spare if window is not None else 0
        self.recent = recent if self.start is not None else 0
        self.offset = 0
        self.converted = False
        self.key_codec = self.value_codec = None
        self.sink = Buffer()  # dense (k, v) of positions [0, keep)
        self.enc = Buffer()  # encoded (k parts..., v parts...), block axis 2
        self.tail = Buffer()  # dense (k, v), positions [tail_start, offset)
        self.enc_start = self.tail_start = self.keep
        self._dims = None  # (B, H, D, Dv, dtype)
        self.joint = False  # K and V in one set of encoded arrays (view.Joint): one codec serves both
        self._fresh = None  # dense (k, v, position) of the blocks the last update encoded
        self.attention = attention  # how attention reads this cache (carried by its views)
        self.stats = stats if stats is not None else AttentionStats()  # shared by one cache set
        self.memo: dict = {}  # attention's per-cache derivations from these settings (KVView.memo)

    # -- layout -------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.key_codec.block_tokens if self.key_codec else 1

    def _ensure_codecs(self, keys: mx.array, values: mx.array) -> None:
        if self._dims is None:
            B, H, _, D = keys.shape
            self._configure((B, H, D, values.shape[-1], keys.dtype))

    def _configure(self, dims: tuple) -> None:
        """Dimensions (B, H, D, Dv, dtype) -> codecs and the encoded layout."""
        self._dims = dims
        self.memo = {}
        _, _, D, Dv, _ = dims
        self.key_codec = make_codec(self.key_spec, D)
        self.value_codec = make_codec(self.value_spec, Dv)
        bt = {c.block_tokens for c in (self.key_codec, self.value_codec) if c}
        if len(bt) > 1:
            raise ValueError("key and value codecs must use the same block size")
        self.enc.step = max(1, STEP // self.block_tokens)  # grow by ~256 tokens
        self.joint = (D == Dv and self.key_spec == self.value_spec and self.key_codec is not None
                      and getattr(self.key_codec, "joint", False))

    @property
    def shape_layout(self) -> Layout | None:
        """The typed layout (None before the first tokens fix the dimensions)."""
        if self._dims is None:
            return None
        B, H, D, Dv, dtype = self._dims
        return Layout(B, H, D, Dv, dtype, getattr(self, "_n_key_parts", None), self.joint, self.block_tokens)

    def like(self, batch: int = 1) -> CompressedKVCache:
        """An empty cache with this one's settings, codecs and dimensions (`batch` rows)."""
        row = CompressedKVCache(self.key_spec, self.value_spec, self.start or 0, self.window, self.keep, self.spare,
                                self.recent, attention=self.attention, stats=self.stats)
        if self._dims is not None:
            row._configure((batch, *self._dims[1:]))
            row.key_codec, row.value_codec = self.key_codec, self.value_codec
        if hasattr(self, "_n_key_parts"):
            row._n_key_parts = self._n_key_parts
        row.converted = self.converted
        return row

    def _store(self, keys: mx.array, values: mx.array) -> None:
        """Encode these tokens into the encoded buffer. Joint storage encodes a decode step's K
        and V in one call; longer runs (prefill, conversion) are encoded apart and written into
        the halves, so no concatenated dense copy of them exists."""
        if self.joint and keys.shape[2] > JOINT_CONCAT_TOKENS:
            ek, ev = self.key_codec.encode(keys), self.value_codec.encode(values)
            self._n_key_parts = len(ek)
            self.enc.append_halves(ek, ev)
        else:
            self.enc.append(self.encode_tokens(keys, values))

    def encode_tokens(self, keys: mx.array, values: mx.array) -> tuple:
        """The encoded parts of these tokens as the buffer stores them."""
        if self.joint:
            parts = None
            if self.attention.cuda_kernel and keys.shape == values.shape and keys.dtype == values.dtype:
                key = ("encoder", keys.dtype, backend_name())
                enc = self.memo.get(key, False)
                if enc is False:
                    enc = self.memo[key] = cuda_encode.encoder(self.key_codec, keys.dtype, keys.shape[-1])
                parts = enc(keys, values) if enc is not None else None
            if parts is None:
                parts = self.key_codec.encode(mx.concatenate([keys, values], axis=1))
            self._n_key_parts = len(parts)
            return parts
        ek = self._side_encoder("key", self.key_codec, keys)(keys)
        self._n_key_parts = len(ek)
        return (*ek, *self._side_encoder("value", self.value_codec, values)(values))

    def _side_encoder(self, side: str, codec, x: mx.array):
        """The codec's encode for inputs like `x`, kept in the memo: a codec with a one-launch encoder (TurboQuant
        on CUDA, `turbo_cuda_encode.encoder`) has its checks made once per cache, not per decode step."""
        key = ("side encoder", side, x.dtype, x.shape[-1], backend_name())
        enc = self.memo.get(key)
        if enc is None:
            make = getattr(codec, "encoder", None)
            enc = self.memo[key] = (make(x.dtype, x.shape[-1]) if make is not None else None) or codec.encode
        return enc

    @property
    def lag(self) -> int:
        """Positions after a block's last token before queries read it encoded."""
        return self.recent + 1 if self.recent else 0

    @property
    def pending_conversion(self) -> bool:
        return self.start is not None and not self.converted and self.offset >= self.start

    # -- protocol -----------------------------------------------------------
    @property
    def _direct(self) -> bool:
        """Steady state of a plain compressed layer: every new token is encoded straight away
        (converted, one token per block, no window, sink or recent tokens, nothing dense left)."""
        return (self.converted and self.window is None and not self.recent and self.tail.n == 0
                and self.key_codec is not None and self.value_codec is not None
                and self.key_codec.block_tokens == 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._ensure_codecs(keys, values)
        if self.pending_conversion:
            self.convert()
        self._fresh = None
        if self._direct:  # the decode hot path: the same storage as below, in fewer steps
            q_start = self.offset
            if not self.enc.n:
                self.enc_start = q_start
            self._store(keys, values)
            self.offset += keys.shape[2]
            self.tail_start = self.offset
            view = self._view(q_start, keys.shape[2], None)
            view.launch = self.memo.get("launch")
            return view, view
        N = keys.shape[2]
        q_start = self.offset
        self._drop_old(q_start)
        n_sink = max(0, min(N, self.keep - self.offset)) if self.window else 0
        if n_sink:
            self.sink.append((keys[:, :, :n_sink], values[:, :, :n_sink]))
        self.tail.append((keys[:, :, n_sink:], values[:, :, n_sink:]))
        self.offset += N
        shadow = self._encode_complete_blocks() if self.converted else None
        view = self._view(q_start, N, shadow)
        return view, view

    def make_room(self, n: int) -> bool:
        """Grow the encoded buffer now if a steady decode step's `n` tokens would not fit (whether it grew): the engine
        asks before a step's forward and materializes each layer's new buffer at once; grown inside the step, every
        layer's old buffer stays beside its new one until the step's graph is done (run 21's 128k affine:4 decode
        peaked at 24.7 GB for 20.9 of weights and K/V)."""
        parts = self.enc.parts
        if parts is None or self.enc.n + n <= parts[0].shape[2]:  # the usual step: room left (checked first, cheap)
            return False
        return self._direct and self.enc.make_room(n)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in all (a prefill about to feed them), so the buffers grow
        once, not at every chunk. Windows are left as they are (they drop old tokens)."""
        if self._dims is None or self.window is not None or tokens <= self.offset:
            return
        if self.start is None or (not self.converted and self.start > tokens):
            self.tail.reserve(tokens - self.tail_start)
        else:
            start = self.enc_start if self.enc.n else self.tail_start
            self.enc.reserve(max(0, tokens - start - self.recent) // self.block_tokens)  # the rest stays dense

    def _drop_old(self, q_start: int) -> None:
        """Drop recent tokens no query from q_start on can see, in TRIM_STEP steps."""
        if self.window is None:
            return
        needed = max(self.keep, q_start - (self.window - self.keep) + 1 - self.spare)
        drop_to = self.keep + (needed - self.keep) // TRIM_STEP * TRIM_STEP
        if self.enc.n and drop_to > self.enc_start:
            k = min(drop_to - self.enc_start, self.enc.n * self.block_tokens)
            self.enc.drop_front(k // self.block_tokens)
            self.enc_start += k
        if not self.enc.n and drop_to > self.tail_start:
            self.tail.drop_front(drop_to - self.tail_start)  # drop_to <= q_start: all stored
            self.tail_start = drop_to
        if not self.enc.n:
            self.enc_start = self.tail_start

    def _encode_complete_blocks(self):
        bt = self.block_tokens
        nb = max(0, self.tail.n - self.recent) // bt
        if nb == 0:
            return None
        k, v = self.tail.get(0, nb * bt)
        if not self.enc.n:
            self.enc_start = self.tail_start
        self._store(k, v)
        self.tail.drop_front(nb * bt)
        self.tail_start += nb * bt
        if bt == 1 and not self.recent:
            return None  # each token is read encoded from its own query on
        self._fresh = (k, v, self.tail_start - nb * bt)
        return self._fresh

    def convert(self, piece: int = CONVERT_PIECE) -> None:
        """Encode everything stored so far (one layer; callers eval between layers), at most
        `piece` tokens per encode call, each piece evaluated before the next, so the codec's
        working arrays (turbo: float32 rotations and indices) are one piece's, not the layer's."""
        if self.converted or self.start is None or self._dims is None:
            self.converted = self.converted or self.start is not None
            return
        self.converted = True
        self.enc_start = self.tail_start
        bt = self.block_tokens
        step = max(piece // bt, 1) * bt
        if self.tail.n - self.recent > step:
            self.enc.reserve((self.tail.n - self.recent) // bt)
            while self.tail.n - self.recent > step:
                k, v = self.tail.get(0, step)
                self._store(k, v)
                self.tail.drop_front(step)
                self.tail_start += step
                mx.eval(self.enc.parts)
        self._encode_complete_blocks()

    def _view(self, q_start: int, N: int, shadow) -> KVView:
        B, H, D, Dv, _ = self._dims
        segs = []
        if self.sink.n:
            k, v = self.sink.get()
            segs.append(Segment(DENSE, k, v, 0, self.sink.n))
        if self.enc.n:
            bt = self.block_tokens
            if self.joint:  # the buffers as they are: consumers slice what they read
                segs.append(Segment(ENCODED, None, None, self.enc_start, self.enc.n * bt, bt, self.key_codec,
                                    self.value_codec, self.lag, joint=Joint(self.enc.parts, H)))
            else:
                ks, vs = self._split_enc()
                segs.append(Segment(ENCODED, ks, vs, self.enc_start, self.enc.n * bt, bt,
                                    self.key_codec, self.value_codec, self.lag))
        if shadow is not None:
            k, v, pos = shadow
            segs.append(Segment(SHADOW, k, v, pos, k.shape[2], self.block_tokens, lag=self.lag))
        if self.tail.n:
            k, v = self.tail.get()
            segs.append(Segment(DENSE, k, v, self.tail_start, self.tail.n))
        return KVView(segs, q_start, N, self.window, self.keep, B, H, D, Dv, self.attention, self.stats, self.memo)

    def _split_enc(self):
        """(key parts, value parts) of the stored blocks."""
        if self.joint:
            return Joint(self.enc.parts, self._dims[1]).halves(self.enc.n)
        parts = self.enc.get()
        return parts[: self._n_key_parts], parts[self._n_key_parts :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # attention over a KVView builds its mask from token positions; this is for code that
        # only checks the kind of mask it gets.
        return None if N == 1 else "causal"

    def size(self) -> int:
        return self.sink.n + self.enc.n * self.block_tokens + self.tail.n

    def empty(self) -> bool:
        return self._dims is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Remove the last n tokens (as many as the window still allows); returns how many."""
        return rollback.trim(self, n)

    @property
    def nbytes(self) -> int:
        return self.sink.nbytes + self.enc.nbytes + self.tail.nbytes

    @property
    def elements(self) -> int:
        """Logical K and V elements stored (tokens x heads x dims)."""
        if self._dims is None:
            return 0
        B, H, D, Dv, _ = self._dims
        return self.size() * B * H * (D + Dv)

    def describe(self) -> dict:
        return {
            "kind": "window" if self.window is not None else "full-attention",
            "window": self.window,
            "keep": self.keep,
            "key": self.key_codec.describe() if self.key_codec else self.key_spec.to_json(),
            "value": self.value_codec.describe() if self.value_codec else self.value_spec.to_json(),
            "start": self.start,
            "recent": self.recent,
            "converted": self.converted,
        }

    @classmethod
    def merge(cls, caches: list):
        """Rows -> one batch cache (mlx-lm's batch protocol)."""
        from .batch import BatchCompressedKVCache

        return BatchCompressedKVCache.merge(caches)
