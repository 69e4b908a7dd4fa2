"""`mlxkv convert-kv IN OUT`: re-encode a saved KV cache under another KV policy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcore.errors import MlxkvError
from kvcore.units import format_bytes

from . import output
from .options import KvBitsOpt, KvConfigOpt, KvGroupOpt, KvOpt


def convert_kv(
    input: Annotated[Path, typer.Argument(help="A cache file saved by `generate --save-cache`.")],
    output_path: Annotated[Path, typer.Argument(metavar="OUTPUT", help="The new cache file (never the input).")],
    kv: KvOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    kv_config: KvConfigOpt = None,
    full: Annotated[bool, typer.Option("--full", help="Decode to full precision (it cannot restore lost information).")] = False,
):
    """Re-encode a KV cache file: full precision, a --kv scheme, affine bits, or per layer (kv_config)."""
    from kvcore.policy import KVOptions, resolve_policy
    from kvcore.store import convert_cache_file
    if full == (kv_bits is not None or kv_config is not None or kv is not None):
        raise MlxkvError("convert-kv needs exactly one target: --kv, --kv-bits, --kv-config or --full")
    policy = resolve_policy(KVOptions(kv_bits, kv_group_size, None, str(kv_config) if kv_config else None, kv=kv))
    result = convert_cache_file(input, output_path, policy)
    for n in result.notices:
        output.notice(n)
    print(f"{input} -> {output_path}: KV {format_bytes(result.bytes_before)} -> {format_bytes(result.bytes_after)} "
          f"({result.bytes_before} -> {result.bytes_after} bytes; file {result.file_bytes} bytes)")
