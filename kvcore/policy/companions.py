"""KV flags that mean nothing without a companion, or that another flag would silently drop.

Checked on the raw flags (and the profile they override) before a policy is resolved, so a
flag is never accepted and ignored: each case is a one-line error naming both flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import MlxkvError

if TYPE_CHECKING:  # pragma: no cover
    from .options import KVOptions


def check_companions(o: "KVOptions", prof: dict) -> None:
    """`o`: the flags (None = not given); `prof`: the profile's [kv] table they override."""
    if o.kv_config and (o.kv_bits is not None or o.kv_group_size is not None):
        raise MlxkvError("--kv-config sets each layer's bits and group: drop --kv-bits/--kv-group-size "
                         "(or give one scheme for every layer with --kv affine:N/gG)")
    bits_from = o.kv_bits is not None or o.kv is not None or prof.get("bits") is not None or "kv" in prof
    if o.kv_group_size is not None and not bits_from:
        raise MlxkvError(f"--kv-group-size {o.kv_group_size} needs --kv-bits (it sets the group of the affine "
                         f"codec; without bits the KV stays full precision)")
    window = o.max_kv_size if o.max_kv_size is not None else prof.get("window") or None
    if o.keep is not None and window is None:
        raise MlxkvError(f"--kv-keep {o.keep} needs --max-kv-size (the sink tokens are kept inside a sliding window)")
