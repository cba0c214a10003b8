"""Rewrite an NGC PyTorch image's pip constraints for vlmrun's build (container/Dockerfile).

    python3 container/constraints.py --torch base|pins [--file /etc/pip/constraint.txt]
    python3 container/constraints.py --built-on-torch            # what TORCH=pins uninstalls first

NGC PyTorch images since 25.03 pin every Python package they were built with in
/etc/pip/constraint.txt (named by PIP_CONSTRAINT, so every `pip install` obeys it). vlmrun needs newer
versions of some of those (transformers, tokenizers, huggingface_hub, pydantic, ...), and with
`--torch pins` another torch: with the file as it is, pip finds no solution. This keeps the pins of the
compiled stack only (COMPILED: torch and what is built against it or links the image's CUDA), so the
rest resolves from vlmrun's own requirements:

- `--torch base` keeps the image's torch and its compiled stack pinned;
- `--torch pins` drops those pins too: the image's torch is replaced by requirements/tested.txt's,
  after `--built-on-torch`'s packages (built against the image's torch; they would fail to load
  against another) are uninstalled.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

#: Packages an NGC image compiled against its torch and CUDA (regular expressions over normalized names).
COMPILED = (
    r"torch",
    r"torchvision",
    r"torchaudio",
    r"triton",
    r"pytorch-triton",
    r"nvidia-.*",
    r"transformer-engine.*",
    r"flash-attn",
    r"apex",
    r"torch-tensorrt",
    r"tensorrt.*",
    r"torchao",
    r"nvfuser.*",
    r"numpy",
    r"cupy.*",
)
#: Of those, the ones built against the image's torch itself: what `--torch pins` removes before it
#: installs another torch (torchvision comes back from requirements/tested.txt).
BUILT_ON_TORCH = (
    "torchvision",
    "torchaudio",
    "transformer-engine",
    "transformer-engine-torch",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
    "flash-attn",
    "apex",
    "torch-tensorrt",
    "torchao",
    "nvfuser",
    "lightning-thunder",
)
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def compiled(name: str) -> bool:
    return any(re.fullmatch(pattern, normalized(name)) for pattern in COMPILED)


def kept_lines(text: str, torch: str) -> list[str]:
    """The constraint lines to keep: the compiled stack's with `torch` "base", none of it with "pins"."""
    kept = []
    for line in text.splitlines():
        m = NAME.match(line)
        if m and compiled(m.group(1)) and torch == "base":
            kept.append(line.strip())
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", choices=("base", "pins"), help="keep the image's torch, or replace it")
    parser.add_argument("--file", type=Path, default=Path("/etc/pip/constraint.txt"))
    parser.add_argument("--built-on-torch", action="store_true", help="print what TORCH=pins uninstalls")
    args = parser.parse_args(argv)
    if args.built_on_torch:
        print(" ".join(BUILT_ON_TORCH))
        return 0
    if args.torch is None:
        parser.error("--torch base|pins (or --built-on-torch)")
    text = args.file.read_text() if args.file.exists() else ""
    kept = kept_lines(text, args.torch)
    header = f"# vlmrun's build (container/constraints.py --torch {args.torch}): the image's compiled stack\n"
    args.file.parent.mkdir(parents=True, exist_ok=True)
    args.file.write_text(header + "".join(line + "\n" for line in kept))
    print(f"{args.file}: kept {len(kept)} of {len(text.splitlines())} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
