"""The Runner: rows -> one model step -> sampled tokens. It holds the running rows' caches.

One running row keeps its own caches as built (mlx-lm's KVCache for full precision, so a lone
row decodes exactly as mlx-lm's generate_step does: no batch mask, no padding); a second row
joining merges them into batch caches (mlx-lm's batch protocol), which stay merged.
With `keep_pages` (serve's prefix cache is attached), rows whose every layer pages (compressed, full
attention: cache/paged.py) go into the pools from the first row, and the pools outlive an empty
batch: the prefix cache pins the pages of the prompts it keeps, and a later row takes them back.
Nothing here reads an array back to the host: the caller reads the sampled tokens once.
"""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..attention.config import DEFAULT as DEFAULT_ATTENTION
from ..adapter_set import select_rows
from ..attention.config import AttentionConfig, AttentionStats
from ..cache.batch import BatchCompressedKVCache
from ..cache.compressed import CompressedKVCache
from ..cache.paged import PagedRows
from ..cache.dense_batch import DenseBatchKVCache
from ..cache.room import make_room
from ..policy import KVPolicy, build_caches
from ..transient import memory_limit
from .forward import forward, prefill_chunk
from .constrain import apply_masks
from .sampling import SamplingConfig, pack_logprobs
from .sequence import Sequence


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Runner:
    def __init__(self, model: nn.Module, policy: KVPolicy, prefill_chunk: int,
                 sampling: SamplingConfig = SamplingConfig(), attention: AttentionConfig = DEFAULT_ATTENTION,
                 merge_single: bool = False, prefill_memory=None):
        self.model, self.policy, self.chunk = model, policy, prefill_chunk
        self.prefill_memory = prefill_memory  # kvcore.transient.PrefillMemory: bounds long prompts
        self.attention = attention
        self.stats = AttentionStats()  # every cache this runner builds counts here
        self.sampling = sampling
        self.sampler = sampling.sampler()  # the engine-wide sampler (seeds the global RNG once)
        self.merge_single = merge_single  # speculative rounds need batch caches from the first row
        self.caches: list | None = None  # the running rows' caches
        self.ids: list = []  # per running row: the token ids its caches held when it joined (or None)
        self.merged = False
        self.keep_pages = False  # lone rows into pages, pools kept when the batch empties (see above)

    def new_caches(self) -> list:
        return build_caches(self.model, self.policy, self.attention, self.stats)[0]

    # -- prefill --------------------------------------------------------------
    def prefill_step(self, seq: Sequence) -> mx.array | None:
        """One chunk of `seq`'s prompt into its own caches; the last position's logits (1, V)
        once the prompt is done, else None."""
        self.select_rows([seq])
        ids = list(seq.request.prompt_ids)
        if seq.prefill_limit is None and self.prefill_memory is not None and len(ids) - seq.done_prompt > self.chunk:
            seq.prefill_limit = self.prefill_memory.limit(len(ids) + seq.request.max_tokens) or 0  # 0: unbounded
        bound = bool(seq.prefill_limit)
        with memory_limit(seq.prefill_limit) if bound else nullcontext():
            seq.done_prompt, logits = prefill_chunk(self.model, ids, seq.caches, seq.done_prompt, self.chunk)
            if seq.done_prompt < len(ids):
                mx.eval([c.state for c in seq.caches])
                return None
            last = logits[:, -1, :]
            if bound:
                mx.eval(last)  # the last chunk's layers run under the bound too
        return last

    def select_rows(self, seqs: list[Sequence]) -> None:
        """The next forward's rows: each through its adapter (kvcore/adapter_set.py)."""
        select_rows(self.model, [s.request for s in seqs])

    # -- membership -------------------------------------------------------------
    def pages_row(self, caches: list) -> bool:
        """Whether a row with these caches joins into pages (`keep_pages`, every layer pages, and the
        running layers, if any, are pools)."""
        if not self.keep_pages or not all(isinstance(c, CompressedKVCache) and c.attention.pages
                                          and PagedRows.accepts([c]) for c in caches):
            return False
        return self.caches is None or self.pooled

    @property
    def pooled(self) -> bool:
        """Whether every layer's running rows are in pages."""
        return self.merged and all(getattr(c, "paged", None) is not None for c in self.caches)

    def row_pages(self, b: int) -> list | None:
        """Running row b's pages, per layer (pool, page ids, tokens); None unless every layer pages."""
        return [(c.paged, *c.paged.row_pages(b)) for c in self.caches] if self.pooled else None

    def join(self, caches: list, ids: list[int] | None = None) -> None:
        """Add one row's caches (`ids`: the tokens they hold, so paged rows can share the pages of
        a prompt prefix other rows hold). Merging is done, and materialized, one layer at a time,
        so the copy a merge makes exists beside the old buffers for one layer only (the byte
        model's join transient)."""
        if self.caches is None:
            self.ids = [ids]
            if self.pages_row(caches):
                self.caches = [_settled(BatchCompressedKVCache.merge([c]), [ids], single=True) for c in caches]
                self.merged = True
            elif self.merge_single:
                self.caches, self.merged = [_settled(type(c).merge([c])) for c in caches], True
            else:
                self.caches, self.merged = caches, False
        elif not self.merged:
            old, self.caches, self.merged = self.caches, [], True
            pair = [self.ids[0] if self.ids else None, ids]
            for i, (a, b) in enumerate(zip(old, caches)):
                merge = DenseBatchKVCache.merge if type(a) is KVCache else type(a).merge
                self.caches.append(_settled(merge([a, b]), pair))
                if isinstance(self.caches[-1], DenseBatchKVCache):
                    self.caches[-1].stats = self.stats  # its calls count with the runner's (the fold's, dense)
                old[i] = None
            self.ids = pair
        else:
            for mine, new in zip(self.caches, caches):
                extend = mine.extend
                if isinstance(mine, BatchCompressedKVCache):
                    extend(type(new).merge([new]), [ids])
                else:  # full precision: the joining row in whole steps already (no second copy in extend)
                    extend((DenseBatchKVCache.merge if type(new) is KVCache else type(new).merge)([new]))
                _settled(mine)
            self.ids.append(ids)

    def reserve(self, finals: list[int]) -> None:
        """Room for the running rows (in order) to reach their final lengths: paged batch rows grow
        their pools now, one layer at a time, rather than all layers at once inside a decode step."""
        if not self.merged:
            return
        for c in self.caches:
            grow = getattr(c, "reserve_tokens", None)
            if grow is not None:
                grow(finals)
                _settled(c)

    def filter(self, keep: list[int]) -> None:
        self.ids = [self.ids[i] for i in keep] if len(self.ids) > max(keep, default=-1) else []
        if not keep and self.keep_pages and self.pooled:
            for c in self.caches:  # the pools stay, their pages free or pinned (`keep_pages`)
                c.filter([])
        elif not keep:
            self.caches, self.merged = None, False
        elif self.merged:
            idx = mx.array(keep)
            for c in self.caches:
                c.filter(idx)
                if isinstance(c, DenseBatchKVCache):  # its copies beside the old buffers for one layer at a time
                    _settled(c)

    def compact(self, min_free: int) -> dict[int, int] | None:
        """Idle pools give back the pages no entry pins (PagedRows.compact): the renumbering, the same in
        every layer (their tables were equal), or None where they keep everything."""
        if not self.pooled or self.ids:
            return None
        moved = [c.paged.compact(min_free) for c in self.caches]
        return moved[0]

    def mark_rows(self, lengths: list[int]) -> None:
        """The running rows' token counts (host-side): full-precision batch caches need no mask
        while every row holds as many tokens as the others."""
        padded = len(set(lengths)) > 1
        for c in self.caches or []:
            if isinstance(c, DenseBatchKVCache):
                c.padded = padded

    # -- decode -----------------------------------------------------------------
    def forward(self, tokens: mx.array) -> mx.array:
        """tokens (B, N) -> logits (B, N, V), lazily."""
        for c in self.caches or []:  # caches grow here, a layer at a time, not every layer inside the step (room.py)
            make_room(c, tokens.shape[1])
        return forward(self.model, tokens, self.caches)

    def sample(self, logits: mx.array, seqs: list[Sequence]) -> mx.array:
        """logits (B, V) -> tokens (B,), lazily; rows with their own sampling settings, seeds or a
        repetition penalty are sampled apart (a seeded row draws from its own random state).
        When a row asks for log-probabilities they ride along: (B, 2 + 2N) (sampling.py).
        Constrained rows that are greedy, or share the engine's sampler, are masked together."""
        lp = logprobs(logits)
        shared = all(s.sampling is self.sampling and s.key is None for s in seqs) and not self.sampling.adjusted
        greedy = all(s.sampling.temp == 0 and not s.sampling.adjusted for s in seqs)
        if shared or greedy:
            masked = lp
            if any(s.constraint is not None for s in seqs):  # one (B, V) mask, its rows' grammars'
                masked = logprobs(apply_masks(logits, [s.constraint and s.constraint.bits() for s in seqs]))
            tokens = mx.argmax(masked, axis=-1) if greedy else self.sampler(masked)
        else:
            tokens = mx.concatenate([sample_row(logits[b : b + 1], s, self, lp[b : b + 1])
                                     for b, s in enumerate(seqs)], axis=0)
        return with_logprobs(tokens, lp, seqs)


def _settled(cache, ids: list | None = None, single: bool = False):
    """Materialize a cache's arrays now (packing batch rows first, where they pack; `ids`: the
    rows' token ids, for paged rows to share prefix pages; `single`: a lone row into pages too)."""
    pack = getattr(cache, "_maybe_pack", None)
    if pack is not None:
        pack(ids, single) if ids is not None else pack()
    state = cache.state
    mx.eval([a for a in (state if isinstance(state, (tuple, list)) else [state]) if isinstance(a, mx.array)])
    return cache


def sample_row(logits: mx.array, seq: Sequence, runner: Runner | None = None, lp: mx.array | None = None) -> mx.array:
    """One row's token from its logits (1, V), with its settings, random state, bias and penalty
    history and counts (which the token joins, lazily). `lp`: the logprobs of `logits`, if at hand."""
    cfg = seq.sampling
    if cfg.counted and seq.counts is None:
        seq.counts = mx.zeros((logits.shape[-1],), mx.float32)
    if cfg.adjusted:
        logits, lp = cfg.penalize(seq.history, logits, seq.counts), None
    if seq.constraint is not None:  # its grammar's mask for the next token
        logits, lp = apply_masks(logits, [seq.constraint.bits()]), None
    lp = logprobs(logits) if lp is None else lp
    if cfg.temp == 0:
        tok = mx.argmax(lp, axis=-1)
    elif seq.key is None:
        tok = (runner.sampler if runner is not None and cfg is runner.sampling else cfg.sampler(seed=False))(lp)
    else:
        seq.key, sub = mx.random.split(seq.key)
        tok = cfg.sample(lp, key=sub)
    if cfg.penalized or cfg.counted:
        seq.remember(tok)
    return tok


def with_logprobs(tokens: mx.array, lp: mx.array, seqs: list[Sequence]) -> mx.array:
    """tokens (B,), or packed with the top-N logprobs when any row asked for them."""
    asked = [s.sampling.logprobs for s in seqs if s.sampling.logprobs is not None]
    return pack_logprobs(tokens, lp, max(asked)) if asked else tokens
