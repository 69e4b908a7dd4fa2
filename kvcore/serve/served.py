"""The served model: loaded once (in the engine thread), with its KV policy, admission budget and
limits; it builds the Engine the worker steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..distributed import load_for_run
from ..engine import Engine, GenerateConfig
from ..models import trained_context
from ..policy import KVPolicy, resolve_policy
from ..jobs.batch import BatchOptions, admission
from ..store import model_fingerprint
from ..transient import PrefillMemory
from .adapters import adapter_fingerprints, check_names, install_lora_modules
from .config import ServeConfig
from .prefix import PrefixCache
from .spill import PrefixDisk, serve_fingerprint


@dataclass
class Served:
    lm: object  # LoadedModel
    policy: KVPolicy
    budget: int
    need: Callable[[list[int]], int]
    config: ServeConfig
    adapters: dict[str, str] = field(default_factory=dict)  # served adapter name -> its folder (--lora-modules)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    @property
    def name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        src = self.lm.source
        return Path(src).name if Path(src).expanduser().exists() else src

    @property
    def models(self) -> list[str]:
        """The model ids clients may name: the base model, then each adapter."""
        return [self.name, *self.adapters]

    @property
    def context(self) -> int | None:
        return trained_context(self.lm.config)

    @property
    def vocab(self) -> int:
        cfg = self.lm.config
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        return int(text.get("vocab_size") or 2**31)

    def new_engine(self) -> Engine:
        c = self.config
        engine = Engine(self.lm.model, self.lm.tokenizer, self.policy, c.batch_size,
                        GenerateConfig(prefill_chunk=c.prefill_chunk,
                                       prefill_memory=PrefillMemory(self.lm.model, self.lm.config, self.policy)),
                        kv_budget=self.budget, batch_need=self.need)
        if c.prefix_cache_bytes or c.prefix_cache_dir:
            disk = None
            if c.prefix_cache_dir:
                fp = serve_fingerprint(model_fingerprint(self.lm.model, self.lm.tokenizer, self.lm.config), c.dtype,
                                       engine.runner.new_caches())
                disk = PrefixDisk(c.prefix_cache_dir, c.prefix_cache_dir_bytes, fp,
                                  adapter_fingerprints(fp, list(self.adapters.values())))
            engine.prefix = PrefixCache(c.prefix_cache_bytes, engine.runner.new_caches, disk)
        return engine


def load_served(config: ServeConfig) -> Served:
    policy = resolve_policy(config.kv)
    lm, _ = load_for_run(config.model, config.dtype, repr(config))
    adapters = install_lora_modules(lm.model, config.lora_modules)
    _, budget, need = admission(lm, policy, BatchOptions(config.batch_size, config.max_kv_bytes), config.prefill_chunk)
    served = Served(lm, policy, budget, need, config, adapters)
    check_names(adapters, served.name)
    return served
