"""Served LoRA adapters (`--lora-modules NAME=DIR`, vLLM's flag): each is a model id clients name;
a request naming one runs that adapter for its rows, batched beside rows of the base model and of
other adapters (kvcore.adapter_set's gathered LoRA layer, installed once at start).

```
name -> folder (resolved)      the rows' Request.adapter, and the prefix cache's key with the ids
folder -> sha256 of its files  the disk tier's fingerprint: a file saved under an adapter is read
                               only under an adapter of the same weights
```
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..adapter_set import AdapterSet
from ..adapters import CONFIG, WEIGHTS
from ..errors import MlxkvError


def install_lora_modules(model, modules: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Install every module's adapter in `model`; served name -> its folder (resolved).
    A folder that does not fit the model is one line naming --lora-modules."""
    if not modules:
        return {}
    try:
        AdapterSet(model, [folder for _, folder in modules])
    except MlxkvError as e:  # AdapterSet names a folder as a prompts file row's "adapter"
        msg = str(e)
        raise MlxkvError("--lora-modules" + msg[len("adapter"):] if msg.startswith("adapter ") else msg) from None
    return {name: str(Path(folder).resolve()) for name, folder in modules}


def check_names(adapters: dict[str, str], base: str) -> None:
    if base in adapters:
        raise MlxkvError(f"--lora-modules {base}={adapters[base]}: the name is the base model's id "
                         "(give the adapter another name, or the model another with --served-model-name)")


def adapter_digest(folder: str | Path) -> str:
    """sha256 of an adapter folder's config and weights: what its cached prompts depend on."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        with open(Path(folder) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def adapter_fingerprints(base: dict, folders: list[str]) -> dict[str, dict]:
    """The disk tier's fingerprint per adapter folder: the base's plus the adapter's digest."""
    return {f: {**base, "serve_adapter_sha256": adapter_digest(f)} for f in dict.fromkeys(folders)}
