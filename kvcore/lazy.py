"""Package namespaces whose names are imported on first use (PEP 562), so importing one light submodule of a
package (what the command line's help needs: `kvcore.policy.kv_spec`, `kvcore.store.atomic`) does not run the
package's heavy siblings, which pull in mlx-lm and, through it, transformers (about 1 s)."""

from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
    """A module `__getattr__` for `package`: each name in `names` comes from the submodule it maps to, imported
    on first use (then kept in the namespace); any other name that is a submodule is imported as one."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            if name.startswith("__"):
                raise AttributeError(name)
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
