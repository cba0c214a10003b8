"""The splits of an Energon-prepared dataset, read from its `.nv-meta` (no tar file is opened)."""

from __future__ import annotations

import json
from pathlib import Path

from vlmrun.errors import InputError, short_repr

_META = ".nv-meta"


def split_shards(path: str | Path, split: str, *, field: str = "data.split") -> list[tuple[str, int]]:
    """(tar name, sample count) of each shard of `split`, read from `.nv-meta` (no tar is opened).

    Raises `InputError` on `data.path` for a folder Energon has not prepared (or whose .nv-meta is
    damaged, naming the file), on `field` (the recipe field that names `split`: data.split or
    data.val_split) for a split it does not have.
    """
    import braceexpand

    counts, parts, exclude = _read_meta(Path(path) / _META, path)
    if split not in parts:
        allowed = f"{path} has the splits: {', '.join(parts) or 'none'}"
        if field == "data.val_split":
            allowed += " (train.val_samples=0 validates on nothing)"
        raise InputError(field, split, allowed)
    excluded = {name for pattern in exclude for name in braceexpand.braceexpand(pattern)}
    names = [n for pattern in parts[split] for n in braceexpand.braceexpand(pattern) if n not in excluded]
    missing = next((n for n in names if n not in counts), None)
    if missing is not None:
        raise _damaged(
            Path(path) / _META / "split.yaml", f"names {short_repr(missing)}, which .info.json does not count"
        )
    return [(name, counts[name]) for name in names]


def _read_meta(meta: Path, path: str | Path) -> tuple[dict[str, int], dict[str, list[str]], list[str]]:
    """(shard counts, split -> shard patterns, excluded patterns) from `.nv-meta`, each checked."""
    from vlmrun.config.load import parse_yaml

    try:
        info = json.loads((meta / ".info.json").read_bytes().decode())
        text = (meta / "split.yaml").read_bytes().decode()
    except (OSError, ValueError, RecursionError):
        raise InputError(
            "data.path",
            str(path),
            "must be an Energon-prepared dataset folder (.nv-meta/ with .info.json and split.yaml)",
        ) from None
    counts = info.get("shard_counts") if isinstance(info, dict) else None
    if not _mapping_of(counts, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise _damaged(meta / ".info.json", "shard_counts is not a mapping of shard names to sample counts")
    splits = parse_yaml(text, str(meta / "split.yaml"), field="data.path")
    parts = (splits.get("split_parts") if isinstance(splits, dict) else None) or {}
    exclude = (splits.get("exclude") if isinstance(splits, dict) else None) or []
    if not isinstance(splits, dict) or not _mapping_of(parts, _names) or not _names(exclude):
        raise _damaged(meta / "split.yaml", "not a mapping with split_parts (split -> shard names) and exclude")
    return counts, parts, exclude


def _mapping_of(value, ok) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and ok(v) for k, v in value.items())


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def _damaged(file: Path, what: str) -> InputError:
    return InputError("data.path", str(file), message=f"data.path: {file} {what} (a damaged Energon .nv-meta)")


def split_size(path: str, split: str, *, field: str = "data.split") -> int:
    """Number of samples in `split` of the Energon dataset at `path`, from `.nv-meta` (fast); `field` as
    `split_shards`."""
    return sum(count for _, count in split_shards(path, split, field=field))
