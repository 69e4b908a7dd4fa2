"""`mlxkv --help` (and every one-line error about flags) builds the command line without importing mlx-lm, whose
package import loads transformers (about 1 s): the commands import the engine when they run."""

from __future__ import annotations

import subprocess
import sys


def test_building_the_command_line_imports_no_mlx_lm():
    code = ("import sys; from mlxkv_cli.main import build_app; build_app(); "
            "print(sorted(m for m in ('mlx_lm', 'transformers', 'kvcore.engine', 'kvcore.cache') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_help_lists_the_registered_drafts():
    from kvcore.speculative import draft_names
    from mlxkv_cli.speculative import DRAFTS

    assert list(DRAFTS) == draft_names()


def test_importing_a_light_kvcore_module_leaves_the_engine_unloaded():
    code = ("import sys, kvcore.errors, kvcore.units, kvcore.policy.kv_spec, kvcore.store.atomic; "
            "print('mlx_lm' in sys.modules, kvcore.__getattr__('KVOptions').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "KVOptions"]
