"""The `--kv` vocabulary: one string names how K and V are stored.

```
full                    full precision
affine:4                affine, 4 bits for K and V, group 64
affine:4/g32            ... group 32
turbo:k4v3              rotation codec, 4-bit keys, 3-bit values
turbo:4/r16             4-bit K and V; the 16 most recent tokens stay full precision
config:FILE             optiq-style per-layer kv_config.json
```
Bits are `N` (K and V alike) or `kNvM`; options after the bits: `/gG` (group size, codecs
that have groups) and `/rR` (recent full-precision window, any codec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..codecs import FULL, CodecSpec, codec_names, make_codec
from ..errors import MlxkvError

DEFAULT_GROUP = 64
GROUPED = ("affine",)  # codecs whose spec carries a group size
_BITS = re.compile(r"^(?:(\d+)|k(\d+)v(\d+))$")
_OPTION = re.compile(r"^([gr])(\d+)$")


@dataclass(frozen=True)
class KvScheme:
    """What one `--kv` value asks for."""

    key: CodecSpec = FULL
    value: CodecSpec = FULL
    recent: int = 0  # most recent tokens kept full precision
    config: str | None = None  # a kv_config file instead of one codec for every layer

    @property
    def compresses(self) -> bool:
        return self.key.compresses or self.value.compresses or self.config is not None

    def label(self) -> str:
        if self.config is not None:
            return f"config:{self.config}"
        return kv_label(self.key, self.value) + (f"/r{self.recent}" if self.recent else "")


def kv_label(key: CodecSpec, value: CodecSpec) -> str:
    """`affine:4/g64`, `turbo:k4v3`, or `K+V` for two different codecs."""
    if key == value:
        return key.label()
    if key.name == value.name and key.group_size == value.group_size and key.compresses:
        group = f"/g{key.group_size}" if key.group_size else ""
        return f"{key.name}:k{key.bits}v{value.bits}{group}"
    return f"{key.label()}+{value.label()}"


def _known() -> str:
    return ", ".join([*codec_names(), "config:FILE"])


def split_kv_list(text: str) -> list[str]:
    """A comma-separated list of `--kv` values (`fidelity`, `bench`, `fit`) -> its items, stripped,
    empty ones dropped: `"full, affine:4,"` -> `["full", "affine:4"]`. Each caller says what an
    empty list means."""
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_kv(text: str) -> KvScheme:
    """`--kv` value -> KvScheme; anything else is a one-line MlxkvError naming it."""
    s = text.strip()
    if s == "full":
        return KvScheme()
    if s.startswith("config:"):
        if not s[len("config:"):]:
            raise MlxkvError("--kv config: needs a file (config:FILE)")
        return KvScheme(config=s[len("config:"):])
    name, _, rest = s.partition(":")
    if name not in codec_names() or name == "full":
        raise MlxkvError(f"unknown --kv value {text!r} (known: {_known()}; e.g. affine:4, turbo:k4v3)")
    bits, *options = rest.split("/")
    m = _BITS.match(bits)
    if not m:
        raise MlxkvError(f"--kv {text!r}: bits must be N or kNvM (e.g. {name}:4, {name}:k4v3)")
    kb, vb = (int(m[1]), int(m[1])) if m[1] else (int(m[2]), int(m[3]))
    group, recent = (DEFAULT_GROUP if name in GROUPED else None), 0
    for opt in options:
        o = _OPTION.match(opt)
        if not o or (o[1] == "g" and name not in GROUPED):
            raise MlxkvError(f"--kv {text!r}: unknown option {opt!r} (options: "
                             f"{'/gGROUP, ' if name in GROUPED else ''}/rRECENT)")
        if o[1] == "g":
            group = int(o[2])
        else:
            recent = int(o[2])
    scheme = KvScheme(CodecSpec(name, kb, group), CodecSpec(name, vb, group), recent)
    for spec in {scheme.key, scheme.value}:
        try:
            make_codec(spec, 64)
        except ValueError as e:
            raise MlxkvError(f"--kv {text!r}: {e}") from None
    return scheme
