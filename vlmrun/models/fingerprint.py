"""A cheap fingerprint of what a model directory holds: other weights at the same `model.path` differ.

The run identity (config/identity.py) records it, so a resume, and the job against its checkpoint,
refuse a model directory whose contents changed since the run began (`model.path contents: old -> new`).
It covers every model the run reads from that directory: the policy's initial weights and GRPO's KL
reference, which is the directory's initial weights too.

What goes in, for every file under the directory (file symlinks followed, as loading follows them):

1. its path relative to the directory and its size;
2. small files (up to SMALL_FILE bytes: config, tokenizer, chat template, processor, the safetensors
   index) hashed whole;
3. large files (the weights) by SAMPLES blocks of BLOCK bytes: the first, the last and the rest
   evenly spaced, about 2 MiB read per file whatever its size, so a 140 GB model costs ~60 MiB of reads.

What it misses, on purpose: mtimes and owners (a copy of the same weights, by cp or rsync, must still
resume); names starting with "." (caches, VCS metadata: loading never reads them); a change inside a
large file that keeps its size and touches no sampled block (a few tensors rewritten in place). Weights
from another training, another seed or another model change the sampled blocks.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SMALL_FILE = 16 << 20
BLOCK = 64 << 10
SAMPLES = 34


def model_contents(model) -> str | None:
    """The fingerprint of the recipe model section's `model.path`; None for a tiny model (built from a
    seed: the identity's `model.tiny`, `model.family` and `train.seed` define it)."""
    return None if model.tiny else directory_fingerprint(Path(model.path))


def directory_fingerprint(root: Path) -> str:
    """'<n> files, <size>, <digest>' of what `root` holds (see the module docstring); reads a few MiB."""
    h = hashlib.sha256()
    count = total = 0
    for rel, path in _files(root):
        size = path.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(path, "rb") as f:
            offsets = [0] if size <= SMALL_FILE else _sample_offsets(size)
            for offset in offsets:
                f.seek(offset)
                h.update(f.read(SMALL_FILE if size <= SMALL_FILE else BLOCK))
        count, total = count + 1, total + size
    return f"{count} files, {_human(total)}, {h.hexdigest()[:16]}"


def _files(root: Path) -> list[tuple[str, Path]]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(folder) / name
            if not name.startswith(".") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _sample_offsets(size: int) -> list[int]:
    last = size - BLOCK
    return [last * k // (SAMPLES - 1) for k in range(SAMPLES)]


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
