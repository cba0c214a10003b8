"""Checkpoints: everything needed for a bitwise-identical continuation. This module owns their layout.

    checkpoints/tmp_step_<N>/        being written (ignored, and removed by the next save)
    checkpoints/step_<N>/            complete
        manifest.json                format, step, every file with its size and sha256, run metadata
        controller.pt                the controller's RNG and step counters
        policy/model.pt              the policy's parts (one copy when every rank holds the same state)
        policy/optimizer.pt          optimizer and LR schedule
        policy/sharded/              or, for a sharded policy (FSDP2): model, optimizer and LR schedule
                                     through torch.distributed.checkpoint, one file per rank + .metadata
        rng/rank_<k>.pt              every rank's RNG
        loader/shard_<r>.pt          every loader shard's Energon state, with its identity fingerprint
        plane/shard_<r>.pt           the data plane's state of replica r, where it is not empty
        generation/replica_<r>.pt    GRPO: replica r's sampling stream (the generation backend's state)

1. Components register their state as *parts*: a rank writes `pending.write(part, state, index)` and
   reads `checkpoint.read(part, index)`; the part's file name is decided here (`PARTS`) and nowhere
   else. `PendingCheckpoint` and `Checkpoint` are small picklable records, so they travel to the Ray
   actors that write and read their parts (the checkpoint folder is on a filesystem all nodes see).
   The policy's parts come as one `PolicyState` (`pending.write_policy` / `checkpoint.read_policy`),
   whose storage says how they are written: one copy by rank 0 for every rank, or, sharded, by every
   rank at once through DCP (each rank writes its own shard, nobody gathers the whole state).
2. Every writer returns {file: size and sha256} of what it wrote, hashed right after writing in the
   writer's process (ranks hash in parallel, from the page cache); `finish` puts them in the manifest,
   fsyncs, renames tmp_step_<N> -> step_<N>, then keeps the newest `keep`. `latest` returns the newest checkpoint that verifies (every listed
   file has its size and checksum, and the parts every checkpoint needs are there); a torn or corrupt
   one is reported and skipped.
3. Format 1 (written before the layered layout: `meta.json`, `model.pt`, `optim.pt`, and loader and
   plane state in one `loader/shard_<r>.pt`) is read through the same `Checkpoint.read`.
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
from typing import Any

from vlmrun.policy.interface import MODEL_PART, OPTIMIZER_PART, POLICY_PARTS, PolicyState, Storage

log = logging.getLogger(__name__)

FORMAT = 2
MANIFEST = "manifest.json"
#: Part -> file, relative to the checkpoint folder; `{index}` is the rank or the loader shard.
PARTS = {
    "controller": "controller.pt",
    **{part: f"policy/{part}.pt" for part in POLICY_PARTS},
    "rng": "rng/rank_{index}.pt",
    "loader": "loader/shard_{index}.pt",
    "plane": "plane/shard_{index}.pt",
    "generation": "generation/replica_{index}.pt",
}
#: The folder of a sharded policy's parts: DCP's files (`__<rank>_<i>.distcp` and `.metadata`) go inside.
SHARDED_POLICY = "policy/sharded"
#: Parts without which no checkpoint can be resumed; the policy's are either every part of
#: POLICY_PARTS (one copy) or the sharded policy's metadata.
REQUIRED = ("controller",)
_DCP_METADATA = ".metadata"
# Format 1: file per part, and the key a part sat under when two parts shared one file.
_V1_MANIFEST = "meta.json"
_V1_PARTS = {
    "controller": "controller.pt",
    MODEL_PART: "model.pt",
    OPTIMIZER_PART: "optim.pt",
    "rng": "rng/rank_{index}.pt",
    "loader": "loader/shard_{index}.pt",
    "plane": "loader/shard_{index}.pt",
}
_V1_KEYS = {"loader": "loader", "plane": "plane"}


class CorruptCheckpoint(Exception):
    """A checkpoint folder that must not be resumed from (torn, damaged, incomplete, unknown format)."""


def part_file(part: str, index: int | None = None, *, layout: dict[str, str] = PARTS) -> str:
    if part not in layout:
        raise ValueError(f"unknown checkpoint part {part!r}; parts are {', '.join(layout)}")
    pattern = layout[part]
    if ("{index}" in pattern) != (index is not None):
        raise ValueError(f"checkpoint part {part!r} {'needs' if index is None else 'takes no'} index")
    return pattern.format(index=index)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written; every writer adds its parts, then the store seals it."""

    step: int
    path: str

    def write(self, part: str, state: Any, index: int | None = None) -> dict[str, dict]:
        """Save `state` (tensors and plain containers) as `part`; returns {file: digest} for `finish`."""
        import torch

        name = part_file(part, index)
        target = Path(self.path) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, target)
        return {name: digest(target)}

    def write_policy(self, state: PolicyState, *, rank: int) -> dict[str, dict]:
        """Save this rank's share of the policy; returns {file: digest} of what this rank wrote.

        One copy (`Storage.REPLICATED`): rank 0 writes every part, the other ranks nothing. Sharded: every
        rank writes its own shard through torch.distributed.checkpoint, all ranks of the process group
        together (collective); rank 0 also writes the metadata.
        """
        if state.storage is Storage.REPLICATED:
            files: dict[str, dict] = {}
            if rank == 0:  # every rank holds the same state
                for part, value in state.parts.items():
                    files |= self.write(part, value)
            return files
        import torch.distributed.checkpoint as dcp

        folder = Path(self.path) / SHARDED_POLICY
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(state.parts, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1, sync_files=False))
        mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / _DCP_METADATA] if rank == 0 else [])
        return {str(f.relative_to(self.path)): digest(f) for f in mine}


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint that verified; `manifest` holds the run metadata written with it."""

    step: int
    path: Path
    manifest: dict

    @property
    def format(self) -> int:
        return int(self.manifest["format"])

    def has(self, part: str, index: int | None = None) -> bool:
        return self._file(part, index) in self.manifest["files"]

    def read(self, part: str, index: int | None = None) -> Any:
        """The state saved as `part`; KeyError when this checkpoint has no such part."""
        import torch

        name = self._file(part, index)
        if name not in self.manifest["files"]:
            raise KeyError(f"checkpoint {self.path} has no {part}{'' if index is None else f' {index}'} ({name})")
        state = torch.load(self.path / name, weights_only=True)
        if self.format == 1 and part in _V1_KEYS:
            return state[_V1_KEYS[part]]
        return state

    @property
    def policy_storage(self) -> Storage:
        """How the policy's parts were written (a format 1 checkpoint holds one copy)."""
        sharded = f"{SHARDED_POLICY}/{_DCP_METADATA}" in self.manifest["files"]
        return Storage.SHARDED if sharded else Storage.REPLICATED

    def read_policy(self, into: PolicyState) -> PolicyState:
        """The policy's parts named in `into`, as this checkpoint holds them. One copy: read whole (`into`
        only names the parts). Sharded: loaded in place into `into`'s tensors, which DCP reshards to their
        layout (a process group's DTensors: collective, like `write_policy`; plain tensors: the whole
        state assembled in this one process); returns `into`."""
        if self.policy_storage is Storage.REPLICATED:
            return PolicyState(Storage.REPLICATED, {part: self.read(part) for part in into.parts})
        import torch.distributed.checkpoint as dcp

        dcp.load(into.parts, storage_reader=dcp.FileSystemReader(str(self.path / SHARDED_POLICY)))
        return into

    def _file(self, part: str, index: int | None) -> str:
        return part_file(part, index, layout=_V1_PARTS if self.format == 1 else PARTS)


class CheckpointStore:
    """The checkpoints of one run under `root`; the newest `keep` complete ones are retained."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = Path(root), keep

    def begin(self, step: int) -> PendingCheckpoint:
        """A fresh, empty tmp_step_<N> folder for the writers."""
        tmp = self.root / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return PendingCheckpoint(step, str(tmp))

    def finish(self, pending: PendingCheckpoint, files: dict[str, dict], meta: dict) -> Path:
        """Seal `pending` ({file: digest} from the writers into the manifest, fsync) and rename it to
        step_<N>; apply retention."""
        tmp = Path(pending.path)
        missing = _lacking(files, PARTS)
        if missing:
            raise ValueError(f"checkpoint step {pending.step} lacks the parts {missing}")
        manifest = dict(
            meta, format=FORMAT, step=pending.step, saved_at=time.time(), files={f: files[f] for f in sorted(files)}
        )
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_tree(tmp)
        final = self.root / f"step_{pending.step}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._retain()
        return final

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every sealed checkpoint, oldest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
                found.append((int(p.name[5:]), p))
        return sorted(found)

    def newest_step(self) -> int | None:
        done = self.complete()
        return done[-1][0] if done else None

    def newest_manifest(self) -> tuple[int, dict] | None:
        """(step, manifest) of the newest sealed checkpoint, read without verifying its files (cheap:
        for checks on a login node); None when there is none or its manifest is unreadable."""
        for step, path in reversed(self.complete()):
            try:
                return step, _read_manifest(path)
            except CorruptCheckpoint:
                continue
        return None

    def at(self, step: int) -> Checkpoint:
        """The sealed checkpoint of `step`, verified; KeyError when there is none, CorruptCheckpoint
        when it does not verify."""
        path = self.root / f"step_{step}"
        if not path.is_dir():
            raise KeyError(f"no checkpoint of step {step} in {self.root}")
        return Checkpoint(step, path, verify(path))

    def latest(self) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint that verifies, and a line for each newer one that was skipped."""
        skipped = []
        for step, path in reversed(self.complete()):
            try:
                return Checkpoint(step, path, verify(path)), skipped
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
    """The manifest of the checkpoint at `path` once every listed file has its recorded size and
    sha256 and the required parts are listed; raises CorruptCheckpoint naming what is wrong."""
    manifest = _read_manifest(path)
    fmt = manifest.get("format")
    if fmt not in (1, FORMAT) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"unknown checkpoint format {fmt!r} (this vlmrun reads formats 1 and {FORMAT})")
    lacking = _lacking(manifest["files"], _V1_PARTS if fmt == 1 else PARTS)
    if lacking:
        raise CorruptCheckpoint(f"the manifest lists no {', '.join(lacking)} part")
    for name, want in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if f.stat().st_size != want.get("size"):
            raise CorruptCheckpoint(f"{name} has {f.stat().st_size} bytes, expected {want.get('size')}")
        if _sha256(f) != want.get("sha256"):
            raise CorruptCheckpoint(f"{name} checksum mismatch")
    return manifest


def _lacking(files, layout: dict[str, str]) -> list[str]:
    """The required parts `files` lacks: the controller's, and the policy's (replicated or sharded)."""
    lacking = [p for p in REQUIRED if part_file(p, layout=layout) not in files]
    if f"{SHARDED_POLICY}/{_DCP_METADATA}" not in files:
        lacking += [p for p in POLICY_PARTS if part_file(p, layout=layout) not in files]
    return lacking


def digest(path: Path) -> dict:
    """{size, sha256} of a written file, as the manifest records it."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _read_manifest(path: Path) -> dict:
    for name in (MANIFEST, _V1_MANIFEST):
        try:
            manifest = json.loads((path / name).read_text())
        except FileNotFoundError:
            continue
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptCheckpoint(f"{name} unreadable: {e}") from None
        if not isinstance(manifest, dict):
            raise CorruptCheckpoint(f"{name} is not a JSON object")
        return manifest
    raise CorruptCheckpoint(f"no {MANIFEST} (torn write)")


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
