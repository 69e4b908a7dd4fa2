"""kvcore: compressed KV caches for mlx-lm models.

```python
from mlx_lm import load
from kvcore import KVOptions, resolve_policy, build_caches

model, tokenizer = load("path/or/repo")
caches, plan = build_caches(model, resolve_policy(KVOptions(kv_bits=4, quantized_kv_start=0)))
logits = model(tokens[None], cache=caches)   # attention reads the compressed caches; no context needed
```
"""

__version__ = "0.1.0"

from .errors import MlxkvError

__all__ = ["KVOptions", "KVPolicy", "MlxkvError", "attention_context", "build_caches", "resolve_policy", "__version__"]

from .lazy import exports  # noqa: E402

# the names that pull in mlx-lm (and with it transformers) are imported on first use, so importing a light
# submodule (kvcore.errors, kvcore.units: what the command line's help needs) stays light
__getattr__ = exports(__name__, {"attention_context": "attention", "KVOptions": "policy", "KVPolicy": "policy",
                                 "build_caches": "policy", "resolve_policy": "policy"})
