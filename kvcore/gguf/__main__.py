"""python -m kvcore.gguf GGUF OUT [--dequantize] [--dtype float32|float16|bfloat16]

Converts a GGUF file into an mlx-lm folder and prints the folder path.
"""

from __future__ import annotations

import argparse
import sys

from kvcore.errors import MlxkvError
from kvcore.gguf.convert import DTYPES, convert_gguf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcore.gguf", description=__doc__.splitlines()[2])
    ap.add_argument("gguf", help="input .gguf file")
    ap.add_argument("out", help="output folder (must not exist or be empty)")
    ap.add_argument("--dequantize", action="store_true", help="store dense weights")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of dense weights / quantization scales")
    args = ap.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out, dequantize=args.dequantize, dtype=args.dtype)
    except MlxkvError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
