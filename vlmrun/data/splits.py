"""The splits of an Energon-prepared dataset, read from its `.nv-meta` (no tar file is opened)."""

from __future__ import annotations

import json
from pathlib import Path

from vlmrun.errors import InputError

_META = ".nv-meta"


def split_shards(path: str | Path, split: str) -> list[tuple[str, int]]:
    """(tar name, sample count) of each shard of `split`, read from `.nv-meta` (no tar is opened).

    Raises `InputError` on `data.path` for a folder Energon has not prepared, on `data.split` for
    a split it does not have.
    """
    import braceexpand
    import yaml

    meta = Path(path) / _META
    try:
        counts = json.loads((meta / ".info.json").read_text())["shard_counts"]
        splits = yaml.safe_load((meta / "split.yaml").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(
            "data.path",
            str(path),
            "must be an Energon-prepared dataset folder (.nv-meta/ with .info.json and split.yaml)",
        ) from None
    parts = splits.get("split_parts") or {}
    if split not in parts:
        raise InputError("data.split", split, f"{path} has the splits: {', '.join(parts) or 'none'}")
    excluded = {name for pattern in splits.get("exclude") or () for name in braceexpand.braceexpand(pattern)}
    names = [n for pattern in parts[split] for n in braceexpand.braceexpand(pattern) if n not in excluded]
    return [(name, int(counts[name])) for name in names]


def split_size(path: str, split: str) -> int:
    """Number of samples in `split` of the Energon dataset at `path`, from `.nv-meta` (fast)."""
    return sum(count for _, count in split_shards(path, split))
