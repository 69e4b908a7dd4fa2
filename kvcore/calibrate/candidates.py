"""What a calibration may choose per layer: a candidate set in the `--kv` vocabulary, with ranges.

```
full              a layer may stay full precision (unlisted in the kv_config)
affine:2..8       affine at every width in 2..8 it has (2, 3, 4, 5, 6, 8), group 64
affine:4/g32/g64  one width, groups 32 and 64
turbo:2..8        rotation codec; with --kv-bits split, keys and values take their widths apart
/r16              every compressed option may also keep the 16 newest tokens full precision
```
Keys and values of one layer share a codec, a group and a recent window (one kv_config entry);
their widths are chosen apart unless `split` is off (`--optiq-compatible`: optiq's format holds
one `bits` per layer, affine only, no recent window). Each layer takes its own recent window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..codecs import FULL, CodecSpec, codec_names, make_codec
from ..errors import MlxkvError
from ..policy.kv_spec import DEFAULT_GROUP, GROUPED, kv_label, split_kv_list

DEFAULT = "full,affine:2..8,turbo:2..8,/r8,/r16,/r32"
OPTIQ_DEFAULT = "full,affine:2..8/g32/g64/g128"
_ITEM = re.compile(r"^([a-z][a-z0-9_-]*):(\d+)(?:\.\.(\d+))?((?:/[gr]\d+)*)$")
_RECENT = re.compile(r"^/r(\d+)$")


@dataclass(frozen=True)
class LayerOption:
    """One layer's choice: key codec, value codec, recent window (tokens kept full precision)."""

    key: CodecSpec = FULL
    value: CodecSpec = FULL
    recent: int = 0

    @property
    def compresses(self) -> bool:
        return self.key.compresses

    def label(self) -> str:
        if not self.compresses:
            return "full"
        return kv_label(self.key, self.value) + (f"/r{self.recent}" if self.recent else "")


@dataclass(frozen=True)
class Family:
    """One `--kv` item: a codec, the widths it may take, its groups (None: ungrouped)."""

    name: str
    bits: tuple[int, ...]
    groups: tuple[int | None, ...]


@dataclass(frozen=True)
class CandidateSet:
    families: tuple[Family, ...]
    recents: tuple[int, ...] = (0,)  # always starts with 0
    full: bool = True
    split: bool = True  # keys and values may take different widths

    def __post_init__(self):
        if not self.families and not self.full:
            raise MlxkvError("--kv: no candidates (e.g. --kv full,affine:2..8,turbo:2..8)")
        if self.recents[0] != 0 or any(r < 0 for r in self.recents):
            raise MlxkvError(f"recent windows must start with 0 and be >= 0, got {list(self.recents)}")

    def specs(self) -> list[CodecSpec]:
        """Every codec spec a key or a value may take (widths x groups of every family)."""
        out = {CodecSpec(f.name, b, g): None for f in self.families for g in f.groups for b in f.bits}
        return list(out)

    def options(self, recent: int) -> list[LayerOption]:
        """Every option of one layer with recent window `recent` (0: none), full first if allowed."""
        out = [LayerOption()] if self.full else []
        for f in self.families:
            for g in f.groups:
                pairs = ((kb, vb) for kb in f.bits for vb in f.bits) if self.split else ((b, b) for b in f.bits)
                out += [LayerOption(CodecSpec(f.name, kb, g), CodecSpec(f.name, vb, g), recent) for kb, vb in pairs]
        return list(dict.fromkeys(out))

    def label(self) -> str:
        items = ["full"] if self.full else []
        for f in self.families:
            groups = "".join(f"/g{g}" for g in f.groups if g is not None)
            items.append(f"{f.name}:{','.join(map(str, f.bits))}{groups}")
        return " ".join(items + [f"/r{r}" for r in self.recents[1:]])


def _codec_bits(name: str, lo: int, hi: int, group: int | None, item: str) -> tuple[int, ...]:
    """The widths in [lo, hi] that codec `name` accepts with `group`."""
    ok, error = [], ""
    for b in range(lo, hi + 1):
        try:
            make_codec(CodecSpec(name, b, group), 64)
        except ValueError as e:
            error = str(e)
            continue
        ok.append(b)
    if not ok:
        raise MlxkvError(f"--kv {item!r}: {error or f'codec {name} takes no width in {lo}..{hi}'}")
    return tuple(ok)


def _family(item: str) -> Family:
    m = _ITEM.match(item)
    if not m:
        raise MlxkvError(f"--kv {item!r}: expected CODEC:BITS or CODEC:LO..HI with /gG or /rR options "
                         f"(e.g. affine:2..8, turbo:3, affine:4/g32, /r16)")
    name, lo, hi, opts = m[1], int(m[2]), int(m[3] or m[2]), m[4]
    if name not in codec_names() or name == "full":
        raise MlxkvError(f"--kv {item!r}: unknown codec {name!r} (known: {', '.join(codec_names())})")
    if hi < lo:
        raise MlxkvError(f"--kv {item!r}: empty range {lo}..{hi}")
    groups, recent = [], []
    for o in re.findall(r"/([gr])(\d+)", opts):
        (groups if o[0] == "g" else recent).append(int(o[1]))
    if recent:
        raise MlxkvError(f"--kv {item!r}: give recent windows as their own item (e.g. --kv {item.split('/')[0]},/r16)")
    if groups and name not in GROUPED:
        raise MlxkvError(f"--kv {item!r}: codec {name} has no group size")
    groups = tuple(dict.fromkeys(groups)) or ((DEFAULT_GROUP,) if name in GROUPED else (None,))
    bits = [_codec_bits(name, lo, hi, g, item) for g in groups]
    return Family(name, bits[0], groups)


def parse_candidates(text: str | None, optiq_compatible: bool = False) -> CandidateSet:
    """`--kv` candidate list -> CandidateSet; anything else is a one-line MlxkvError naming it."""
    if text is None:
        text = OPTIQ_DEFAULT if optiq_compatible else DEFAULT
    items = split_kv_list(text)
    if not items:
        raise MlxkvError("--kv: no candidates (e.g. --kv full,affine:2..8,turbo:2..8)")
    families, recents, full = [], [0], False
    for item in items:
        if item == "full":
            full = True
        elif (r := _RECENT.match(item)) is not None:
            if int(r[1]) > 0:
                recents.append(int(r[1]))
        else:
            families.append(_family(item))
    if optiq_compatible:
        bad = [f.name for f in families if f.name != "affine"] + (["/r"] if len(recents) > 1 else [])
        if bad:
            raise MlxkvError(f"--optiq-compatible: {bad[0]} is not in optiq's format (affine bits and group "
                             f"per layer, keys and values alike, no recent window)")
    return CandidateSet(tuple(families), tuple(sorted(set(recents))), full, split=not optiq_compatible)
