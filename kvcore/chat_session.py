"""A chat whose KV cache persists across turns: only what a turn adds is prefilled.

Each turn renders the whole conversation with the chat template (engine/chat.py), keeps the
caches' longest common prefix with it (rolling back what differs, where the caches can) and
prefills the rest; the answer is decoded into the same caches. `save`/`load` go through the
cache files (kvcore/store) with the conversation beside them (FILE.chat.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .attention.hook import bind
from .engine import Completion, GenerateConfig, Request, SamplingConfig, generate_one, kv_summary
from .engine.chat import conversation, held_ids, load_conversation, render, save_conversation, turn_delta
from .engine.forward import DEFAULT_PREFILL_CHUNK, cache_offset
from .engine.prompt import encode_continuation
from .engine.reuse import reuse_prefix
from .errors import MlxkvError
from .policy import KVPolicy, build_caches
from .transient import PrefillMemory
from .store.atomic import check_target


@dataclass
class Turn:
    completion: Completion
    reused: int  # context tokens the caches already held
    prefilled: int  # context tokens fed this turn


class ChatSession:
    def __init__(self, lm, policy: KVPolicy, sampling: SamplingConfig = SamplingConfig(), system: str | None = None,
                 max_tokens: int = 512, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 on_notice: Callable[[str], None] | None = None):
        if max_tokens < 1:
            raise MlxkvError(f"--max-tokens must be >= 1, got {max_tokens}")
        render(lm.tokenizer, [{"role": "user", "content": "x"}])  # no chat template: one line, now
        self.lm, self.policy, self.sampling, self.system = lm, policy, sampling, system
        self.max_tokens, self.chunk = max_tokens, prefill_chunk
        self.note = on_notice or (lambda msg: None)
        self.turns = 0
        self.last: Turn | None = None  # the last turn's figures
        self.reset()

    # -- state ----------------------------------------------------------------------
    def reset(self) -> None:
        self._fresh = lambda: build_caches(self.lm.model, self.policy)[0]
        self.memory = PrefillMemory(self.lm.model, self.lm.config, self.policy)  # long turns prefill within the memory model
        self.caches = self._fresh()
        self.ids: list[int] = []  # the tokens the caches hold
        self.messages: list[dict] | None = conversation([], self.system)  # None: unknown (a bare cache file)
        self.source = "new"
        self.turns, self.last = 0, None

    def stats(self) -> dict:
        return {"tokens": len(self.ids), "turns": self.turns, "source": self.source, **kv_summary(self.caches)}

    # -- a turn -----------------------------------------------------------------------
    def context_for(self, text: str) -> list[int]:
        """The whole context a new user turn `text` makes."""
        if self.messages is None:
            delta = turn_delta(self.lm.tokenizer, self.ids, text)
            return self.ids + (delta if delta is not None else encode_continuation(self.lm.tokenizer, text, chat=True))
        return render(self.lm.tokenizer, self.messages + [{"role": "user", "content": text}])

    def ask(self, text: str, on_text: Callable[[str], None] | None = None, max_tokens: int | None = None) -> Turn:
        """Answer `text`; a KeyboardInterrupt stops the answer (finish reason "abort"), not the session."""
        context = self.context_for(text)
        kept = self._reuse(context)
        out = generate_one(self.lm.model, self.lm.tokenizer, Request(tuple(context), max_tokens or self.max_tokens),
                           self.caches, GenerateConfig(self.sampling, self.chunk, self.memory), on_text, held=kept,
                           interruptible=True)
        self._settle(context, out)
        if self.messages is not None:
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": out.text}]
        self.turns += 1
        self.last = Turn(out, kept, len(context) - kept)
        return self.last

    def _reuse(self, context: list[int]) -> int:
        reuse = reuse_prefix(self.caches, self.ids, context)
        if reuse.blocked:
            self.note(f"cannot keep the cached conversation ({reuse.blocked}): prefilling all {len(context)} tokens")
            self.caches = self._fresh()
            return 0
        return reuse.kept

    def _settle(self, context: list[int], out: Completion) -> None:
        """Record what the caches hold; a step queued past an interrupted answer is rolled back."""
        n = cache_offset(self.caches)
        held = held_ids(context, out, n)
        if n > len(held):
            extra = n - len(held)
            if all(c.is_trimmable() for c in self.caches) and all(c.trim(extra) == extra for c in self.caches):
                n = len(held)
            else:
                self.note("the interrupted answer left the caches ahead of the conversation: starting them afresh")
                self.caches, held = self._fresh(), []
        self.ids = held

    # -- files ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Save the caches (and the conversation beside them); returns the cache file's bytes."""
        from .store import model_fingerprint, save_cache

        if not self.ids:
            raise MlxkvError("nothing to save yet: the conversation is empty")
        check_target(path)
        fp = model_fingerprint(self.lm.model, self.lm.tokenizer, self.lm.config)
        size = save_cache(path, self.caches, self.ids, fp)
        if self.messages is not None:
            save_conversation(path, self.messages, self.ids)
        return size

    def load(self, path: str | Path) -> None:
        """Continue from a cache file (its KV policy; its conversation when saved beside it)."""
        from .jobs.resume import open_for_model

        cf = open_for_model(path, self.lm)
        caches = cf.restore()
        if any(p.compresses for p in cf.plan()):
            bind(self.lm.model)
        messages = load_conversation(path, cf.prefix_ids)
        if messages is None:
            self.note(f"{path} has no conversation beside it: new turns follow its {len(cf.prefix_ids)} tokens")
        self.caches, self.ids, self.messages, self._fresh = caches, list(cf.prefix_ids), messages, cf.fresh
        self.source = str(path)
