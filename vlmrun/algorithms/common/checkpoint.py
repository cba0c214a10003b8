"""Checkpoints: everything needed for a bitwise-identical continuation, written atomically.

    checkpoints/tmp_step_<N>/   being written (ignored and removed by readers)
    checkpoints/step_<N>/       complete: meta.json lists every file with its size and sha256
        meta.json  model.pt  optim.pt  controller.pt  rng/rank_<k>.pt  loader/shard_<r>.pt

The newest checkpoint that verifies wins; a torn or corrupt one is reported and skipped. `keep`
complete checkpoints are retained.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1


class CorruptCheckpoint(Exception):
    pass


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    meta: dict


class CheckpointStore:
    def __init__(self, root: Path, keep: int):
        self.root, self.keep = Path(root), keep

    def begin(self, step: int) -> Path:
        """A fresh, empty tmp_step_<N> folder for the ranks to write into."""
        tmp = self.root / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def finish(self, step: int, tmp: Path, meta: dict, files: list[str]) -> Path:
        """Seal `tmp` (checksums into meta.json, fsync) and rename it to step_<N>; apply retention."""
        meta = dict(meta, format=FORMAT, step=step, saved_at=time.time(),
                    files={f: {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in sorted(files)})
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_tree(tmp)
        final = self.root / f"step_{step}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._retain()
        return final

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
                found.append((int(p.name[5:]), p))
        return sorted(found)

    def latest(self) -> tuple[Found | None, list[str]]:
        """The newest checkpoint that verifies, and a line for each newer one that was skipped."""
        skipped = []
        for step, path in reversed(self.complete()):
            try:
                return Found(step, path, verify(path)), skipped
            except CorruptCheckpoint as e:
                skipped.append(f"skipped {path.name}: {e}")
                log.warning("skipping checkpoint %s: %s", path, e)
        return None, skipped

    def _retain(self) -> None:
        for tmp in self.root.glob("tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        done = self.complete()
        for _, path in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)


def verify(path: Path) -> dict:
    """meta.json parses and every listed file has its recorded size and sha256."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint("no meta.json (torn write)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"meta.json unreadable: {e}") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CorruptCheckpoint(f"unknown checkpoint format {meta.get('format')!r}")
    for name, want in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if f.stat().st_size != want["size"]:
            raise CorruptCheckpoint(f"{name} has {f.stat().st_size} bytes, expected {want['size']}")
        if _sha256(f) != want["sha256"]:
            raise CorruptCheckpoint(f"{name} checksum mismatch")
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
