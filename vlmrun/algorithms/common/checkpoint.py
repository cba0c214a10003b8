"""Checkpoints: everything needed for a bitwise-identical continuation. This module owns their format.

    checkpoints/owner.json           the run this folder belongs to (checkpoint_owner.py)
    checkpoints/tmp_step_<N>/        being written (ignored, and removed by the next save)
    checkpoints/damaged_step_<N>-<time>/  a checkpoint found damaged, moved aside for inspection
    checkpoints/step_<N>/            complete
        manifest.json                format, step, the run that wrote it (run_id, run_dir), every file
                                     with its size and checksum (checkpoint_files.py), run metadata
        controller.json              the controller's RNG (python's: it draws no other) and step counters
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
2. Every writer returns {file: size and checksum} of what it wrote, hashed as the bytes go out (torch.save
   and DCP write through a hashing stream, checkpoint_files.py: no file is read back; ranks hash in
   parallel, each its own files); `seal` writes them into the manifest and fsyncs. `verify` checks every listed file's size,
   then hashes the files on several threads at once (a resume reads the checkpoint once, at the
   storage's pace rather than one core's), and that the parts every checkpoint needs are there. The
   store (checkpoint_store.py) names, lists, retains and guards the folders.
3. Format 1 (written before the layered layout: `meta.json`, `model.pt`, `optim.pt`, and loader and
   plane state in one `loader/shard_<r>.pt`) is read through the same `Checkpoint.read`. Format 2 is
   format 3's layout with sha256 where format 3 records XXH3-128 (checkpoint_files.py, 2). Formats 2
   and 3 hold the controller's part as `controller.pt` (torch.save, with numpy's and torch's RNG
   beside python's); format 4 writes it as JSON, so that the controller, which draws no random number
   of numpy or torch, never imports torch (~1.2 s of CPU at every attempt's start, before any rank
   could be started). A part whose file ends in `.json` is JSON; every other part is `torch.save`'s.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrun.algorithms.common import checkpoint_files as files
from vlmrun.policy.interface import MODEL_PART, OPTIMIZER_PART, POLICY_PARTS, PolicyState, Storage

FORMAT = 4
#: Formats `verify` and `Checkpoint` read: 1 (the earlier layout, module doc 3), 2 (sha256 per file), 3
#: (the controller's part in torch's format) and 4.
READS = (1, 2, 3, FORMAT)
MANIFEST = "manifest.json"
#: Part -> file, relative to the checkpoint folder; `{index}` is the rank or the loader shard.
PARTS = {
    "controller": "controller.json",
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
#: Files `verify` hashes at once: enough to keep a parallel filesystem's reads in flight, few enough
#: for a login node.
_HASH_THREADS = min(8, os.cpu_count() or 1)
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
# Formats 2 and 3: format 4's files but the controller's.
_V3_PARTS = PARTS | {"controller": "controller.pt"}


def _layout(fmt: int) -> dict[str, str]:
    return _V1_PARTS if fmt == 1 else _V3_PARTS if fmt in (2, 3) else PARTS


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
        """Save `state` as `part`; returns {file: digest} for `finish`. A JSON part (module doc, 3) takes
        what `json` writes; the others tensors and plain containers."""
        name = part_file(part, index)
        target = Path(self.path) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".json"):
            with open(target, "wb") as raw:
                hashed = files.HashingStream(raw)
                hashed.write(json.dumps(state).encode())
                hashed.flush()
            return {name: hashed.digest()}
        import torch

        with open(target, "wb") as raw, files.hashing_writes(raw) as hashed:
            torch.save(state, hashed)
        return {name: hashed.digest()}

    def write_policy(self, state: PolicyState, *, rank: int) -> dict[str, dict]:
        """Save this rank's share of the policy; returns {file: digest} of what this rank wrote.

        One copy (`Storage.REPLICATED`): rank 0 writes every part, the other ranks nothing. Sharded: every
        rank writes its own shard through torch.distributed.checkpoint, all ranks of the process group
        together (collective); rank 0 also writes the metadata.
        """
        return self.start_policy_write(state, rank=rank, background=False).result()

    def start_policy_write(self, state: PolicyState, *, rank: int, background: bool = True, group=None) -> PolicyWrite:
        """`write_policy` with the writing on a thread of this process (`background`): on return the
        state is copied (host memory), so the caller may change it; the files are written while it goes
        on. Sharded, the copy and the writing are DCP's `async_save`, collective over `group` (a process
        group of its own: the thread's collectives must not interleave with the training's)."""
        if state.storage is Storage.REPLICATED:
            if rank != 0:  # every rank holds the same state: rank 0 writes it
                return PolicyWrite.finished({})
            if not background:
                return PolicyWrite.finished(self._write_parts(state.parts))
            staged = _host_copy(state.parts)
            return PolicyWrite.on_thread(lambda: self._write_parts(staged))
        import torch.distributed.checkpoint as dcp

        folder = Path(self.path) / SHARDED_POLICY
        folder.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(folder), thread_count=1, sync_files=False)
        writer.fs = files.hashing_file_system()  # DCP writes through `fs` (torch's fsspec writer swaps it too)

        def digests() -> dict[str, dict]:
            import torch

            mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / _DCP_METADATA] if rank == 0 else [])
            unhashed = [f.name for f in mine if f not in writer.fs.digests]
            if unhashed:
                raise RuntimeError(f"DCP wrote {unhashed} past the hashing stream (torch {torch.__version__})")
            return {str(f.relative_to(self.path)): writer.fs.digests[f] for f in mine}

        if not background:
            dcp.save(state.parts, storage_writer=writer)
            return PolicyWrite.finished(digests())
        # DCP's writer stages the state into host memory (a copy) before async_save returns
        written = dcp.async_save(state.parts, storage_writer=writer, process_group=group)
        return PolicyWrite(getattr(written, "upload_completion", written), then=digests)  # a Future either way

    def _write_parts(self, parts: dict[str, Any]) -> dict[str, dict]:
        files: dict[str, dict] = {}
        for part, value in parts.items():
            files |= self.write(part, value)
        return files


class PolicyWrite:
    """A policy write in progress (`PendingCheckpoint.start_policy_write`): `done()` without waiting,
    `result()` waits and gives {file: digest}, or raises what the write raised; both may be asked again."""

    def __init__(self, future, then=None):
        self._future, self._then, self._digests = future, then, None

    @classmethod
    def finished(cls, digests: dict[str, dict]) -> PolicyWrite:
        write = cls(None)
        write._digests = digests
        return write

    @classmethod
    def on_thread(cls, work) -> PolicyWrite:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrun-checkpoint")
        future = pool.submit(work)
        pool.shutdown(wait=False)  # the thread ends with the work
        return cls(future)

    def done(self) -> bool:
        return self._digests is not None or self._future.done()

    def result(self) -> dict[str, dict]:
        if self._digests is None:
            out = self._future.result()
            self._digests = self._then() if self._then is not None else out
        return self._digests


def _host_copy(value: Any) -> Any:
    """A copy of `value` (tensors and plain containers) that shares no storage with it, in host memory."""
    import copy

    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _host_copy(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


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
        name = self._file(part, index)
        if name not in self.manifest["files"]:
            raise KeyError(f"checkpoint {self.path} has no {part}{'' if index is None else f' {index}'} ({name})")
        if name.endswith(".json"):
            return json.loads((self.path / name).read_bytes())
        import torch

        state = torch.load(self.path / name, weights_only=True)
        if self.format == 1 and part in _V1_KEYS:
            return state[_V1_KEYS[part]]
        return state

    @property
    def policy_storage(self) -> Storage:
        """How the policy's parts were written (a format 1 checkpoint holds one copy)."""
        sharded = f"{SHARDED_POLICY}/{_DCP_METADATA}" in self.manifest["files"]
        return Storage.SHARDED if sharded else Storage.REPLICATED

    def read_policy(self, into: PolicyState, group=None) -> PolicyState:
        """The policy's parts named in `into`, as this checkpoint holds them. One copy: read whole (`into`
        only names the parts). Sharded: loaded in place into `into`'s tensors, which DCP reshards to their
        layout (a process group's DTensors: collective over `group`, default the default group, like
        `write_policy`; plain tensors: the whole state assembled in this one process); returns `into`."""
        if self.policy_storage is Storage.REPLICATED:
            return PolicyState(Storage.REPLICATED, {part: self.read(part) for part in into.parts})
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(self.path / SHARDED_POLICY))
        dcp.load(into.parts, storage_reader=reader, process_group=group)
        return into

    def _file(self, part: str, index: int | None) -> str:
        return part_file(part, index, layout=_layout(self.format))


def verify(path: Path, *, checksums: bool = True, threads: int | None = None) -> dict:
    """The manifest of the checkpoint at `path` once every listed file has its recorded size and
    checksum and the required parts are listed; raises CorruptCheckpoint naming what is wrong.

    `checksums=False` checks presence and sizes only (a stat per file, no read): for a checkpoint
    whose files were hashed when they were written, to see that it is still whole. The files are
    hashed on `threads` threads at once (default: up to 8).
    """
    manifest = read_manifest(path)
    fmt = manifest.get("format")
    if fmt not in READS or not isinstance(manifest.get("files"), dict):
        reads = ", ".join(map(str, READS))
        raise CorruptCheckpoint(f"unknown checkpoint format {fmt!r} (this vlmrun reads formats {reads})")
    lacking = lacking_parts(manifest["files"], _layout(fmt))
    if lacking:
        raise CorruptCheckpoint(f"the manifest lists no {', '.join(lacking)} part")
    for name, want in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if f.stat().st_size != want.get("size"):
            raise CorruptCheckpoint(f"{name} has {f.stat().st_size} bytes, expected {want.get('size')}")
    if checksums:
        wanted = {name: files.recorded(entry) for name, entry in manifest["files"].items()}
        with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), threads or _HASH_THREADS))) as pool:
            sums = list(pool.map(lambda name: files.file_checksum(path / name, wanted[name][0]), wanted))
        for (name, (_, want)), got in zip(wanted.items(), sums, strict=True):
            if got != want:
                raise CorruptCheckpoint(f"{name} checksum mismatch")
    return manifest


def lacking_parts(files, layout: dict[str, str] = PARTS) -> list[str]:
    """The required parts `files` lacks: the controller's, and the policy's (replicated or sharded)."""
    lacking = [p for p in REQUIRED if part_file(p, layout=layout) not in files]
    if f"{SHARDED_POLICY}/{_DCP_METADATA}" not in files:
        lacking += [p for p in POLICY_PARTS if part_file(p, layout=layout) not in files]
    return lacking


def manifest_file(path: Path) -> Path:
    """The manifest of the checkpoint folder `path` (format 1's meta.json when only that is there)."""
    return path / _V1_MANIFEST if not (path / MANIFEST).exists() and (path / _V1_MANIFEST).exists() else path / MANIFEST


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint folder `path`, unverified; CorruptCheckpoint when it is missing or
    not a JSON object."""
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


def seal(folder: Path, manifest: dict) -> None:
    """Write `manifest` into `folder` and fsync every file and folder in it (checkpoint_files.seal)."""
    files.seal(folder, manifest, MANIFEST)


def digest(path: Path) -> dict:
    """{size, checksum} of a file on disk, as the manifest records it (checkpoint_files.digest)."""
    return files.digest(path)
