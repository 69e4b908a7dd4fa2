"""How attention over compressed caches runs, and what ran: one frozen config, counters per cache set.

`AttentionConfig` travels with the caches (every view a cache hands to attention carries it),
so nothing is read from or written to module globals: a test or script that wants the
blockwise path or no accelerator builds its caches with another config.
`AttentionStats` are the counters one `build_caches` call shares between its layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import MlxkvError


def _env_kernel() -> bool:
    """MLXKV_CUDA_DECODE=0 / 1 turns the CUDA decode kernel off / on; unset: on where the backend is CUDA."""
    v = os.environ.get("MLXKV_CUDA_DECODE", "")
    if v in ("0", "1"):
        return v == "1"
    from ..backend import backend_name

    return backend_name() == "cuda"


@dataclass(frozen=True)
class AttentionConfig:
    fused_bytes: int = 256 * 2**20  # batch decode (packed, stacked rows): decoded K+V up to which one fused call serves
    scratch_bytes: int | None = None  # one row's call: bound on its transient (scratch.CallBytes); None: device default
    block_bytes: int = 64 * 2**20  # per block of the blockwise path
    block: int | None = None  # tokens per block; set: always blockwise (tests), None: from block_bytes
    qmm: bool = True  # CPU/Metal: decode attention from packed words with mx.quantized_matmul
    cuda_kernel: bool = field(default_factory=_env_kernel)  # CUDA: the fused decode kernel
    cuda_min_tokens: int = 8192  # ... for calls reading rows x stored tokens >= this (H200 crossover); 0: all
    rotated: bool = True  # rotation codecs: attend in the rotated basis
    paged: bool | None = None  # batch rows in pages (cache/paged.py); None: off CUDA (its kernel reads packed rows)

    def __post_init__(self):
        for name in ("fused_bytes", "block_bytes"):
            if getattr(self, name) < 1:
                raise MlxkvError(f"attention {name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_min_tokens < 0:
            raise MlxkvError(f"attention cuda_min_tokens must be >= 0, got {self.cuda_min_tokens}")
        if self.scratch_bytes is not None and self.scratch_bytes < 0:
            raise MlxkvError(f"attention scratch_bytes must be >= 0, got {self.scratch_bytes}")
        if self.block is not None and self.block < 1:
            raise MlxkvError(f"attention block must be >= 1 token, got {self.block}")

    @property
    def scratch_limit(self) -> int:
        """`scratch_bytes`, or the device's default (`kvcore.attention.prefill.default_scratch_bytes`)."""
        if self.scratch_bytes is not None:
            return self.scratch_bytes
        from .prefill import default_scratch_bytes

        return default_scratch_bytes()

    @property
    def pages(self) -> bool:
        """Whether batch rows are kept in pages here (`paged`, or by the backend)."""
        if self.paged is not None:
            return self.paged
        from ..backend import backend_name

        return backend_name() != "cuda"

    @property
    def accelerated(self) -> bool:
        """Whether the accelerators (qmm, kernel) may serve: never when blocks are forced."""
        return self.block is None


DEFAULT = AttentionConfig()


@dataclass
class AttentionStats:
    """Attention calls by path, over every layer of one cache set."""

    calls: dict = field(default_factory=dict)  # path -> calls ("fused", "blockwise", "qmm", "cuda-kernel", ...)
    dense_calls: int = 0
    folded: int = 0  # dense batch-row calls that went through attention/dense_fold.py

    def record(self, path: str) -> None:
        self.calls[path] = self.calls.get(path, 0) + 1

    @property
    def compressed_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def path(self) -> str:
        """`mlx-fast-sdpa` when nothing compressed was read (`mlx-fast-sdpa-folded` where dense batch rows went
        through the fold), else `mlxkv-<paths, most used first>`."""
        if not self.calls:
            return "mlx-fast-sdpa-folded" if self.folded else "mlx-fast-sdpa"
        return "mlxkv-" + "+".join(sorted(self.calls, key=lambda p: (-self.calls[p], p)))

    def to_json(self) -> dict:
        return {"path": self.path, "calls": dict(self.calls), **({"dense_folded": self.folded} if self.folded else {})}
