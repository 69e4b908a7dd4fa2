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

from .attention import attention_context
from .errors import MlxkvError
from .policy import KVOptions, KVPolicy, build_caches, resolve_policy

__all__ = ["KVOptions", "KVPolicy", "MlxkvError", "attention_context", "build_caches", "resolve_policy", "__version__"]
