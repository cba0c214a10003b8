"""Reading a checkpoint: `verify` a folder against its manifest, then read its parts from `Checkpoint`.

`verify` checks every listed file's size, hashes the files on several threads at once (a resume reads
the checkpoint once, at the storage's pace rather than one core's), and checks that the parts every
checkpoint needs are listed. `Checkpoint.read(part, index)` gives a part back by the name it was written
under, in any format this vlmrun reads (READS; the older layouts in legacy.py). A part whose file ends in
`.json` is JSON; every other part is `torch.save`'s.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrun.checkpoint import files, legacy
from vlmrun.checkpoint.manifest import FORMAT, CorruptCheckpoint, Manifest, read_manifest
from vlmrun.checkpoint.parts import (
    PIECES_POLICY,
    SHARDED_METADATA,
    SHARDED_POLICY,
    PieceFiles,
    PolicyState,
    Storage,
    lacking_parts,
    part_file,
)

#: Formats `verify` and `Checkpoint` read: the older ones of legacy.py and the current one.
READS = (1, 2, 3, FORMAT)
#: Files `verify` hashes at once: enough to keep a parallel filesystem's reads in flight, few enough
#: for a login node.
_HASH_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint that verified, with its manifest."""

    step: int
    path: Path
    manifest: Manifest

    @property
    def format(self) -> int:
        return self.manifest.format

    def has(self, part: str, index: int | None = None) -> bool:
        return self._file(part, index) in self.manifest.files

    def read(self, part: str, index: int | None = None) -> Any:
        """The state saved as `part`; KeyError when this checkpoint has no such part."""
        name = self._file(part, index)
        if name not in self.manifest.files:
            raise KeyError(f"checkpoint {self.path} has no {part}{'' if index is None else f' {index}'} ({name})")
        if name.endswith(".json"):
            return json.loads((self.path / name).read_bytes())
        import torch

        return legacy.unpack(self.format, part, torch.load(self.path / name, weights_only=True))

    @property
    def policy_storage(self) -> Storage:
        """How the policy's parts were written (a format 1 checkpoint holds one copy)."""
        if SHARDED_METADATA in self.manifest.files:
            return Storage.SHARDED
        if any(name.startswith(f"{PIECES_POLICY}/") for name in self.manifest.files):
            return Storage.PIECES
        return Storage.REPLICATED

    def read_policy(self, into: PolicyState, group=None) -> PolicyState:
        """The policy's parts named in `into`, as this checkpoint holds them. One copy: read whole (`into`
        only names the parts). Sharded: loaded in place into `into`'s tensors, which DCP reshards to their
        layout (a process group's DTensors: collective over `group`, default the default group, like
        `write_policy`; plain tensors: the whole state assembled in this one process); returns `into`.
        Pieces: every writer's file of each part (`PieceFiles`), for the policy to take its pieces from."""
        if self.policy_storage is Storage.REPLICATED:
            return PolicyState(Storage.REPLICATED, {part: self.read(part) for part in into.parts})
        if self.policy_storage is Storage.PIECES:
            return PolicyState(Storage.PIECES, {part: self._piece_files(part) for part in into.parts})
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(self.path / SHARDED_POLICY))
        dcp.load(into.parts, storage_reader=reader, process_group=group)
        return into

    def _piece_files(self, part: str) -> PieceFiles:
        """Writer 0, 1, ... of the pieces of `part`, as the manifest lists them."""
        writers = []
        while (name := self._file(f"pieces_{part}", len(writers))) in self.manifest.files:
            writers.append(str(self.path / name))
        return PieceFiles(tuple(writers))

    def _file(self, part: str, index: int | None) -> str:
        return part_file(part, index, layout=legacy.layout(self.format))


def verify(path: Path, *, checksums: bool = True, threads: int | None = None) -> Manifest:
    """The manifest of the checkpoint at `path` once every listed file has its recorded size and
    checksum and the required parts are listed; raises CorruptCheckpoint naming what is wrong.

    `checksums=False` checks presence and sizes only (a stat per file, no read): for a checkpoint
    whose files were hashed when they were written, to see that it is still whole. The files are
    hashed on `threads` threads at once (default: up to 8).
    """
    manifest = read_manifest(path)
    if manifest.format not in READS:
        reads = ", ".join(map(str, READS))
        raise CorruptCheckpoint(f"unknown checkpoint format {manifest.format!r} (this vlmrun reads formats {reads})")
    lacking = lacking_parts(manifest.files, legacy.layout(manifest.format))
    if lacking:
        raise CorruptCheckpoint(f"the manifest lists no {', '.join(lacking)} part")
    for name, want in manifest.files.items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if f.stat().st_size != want.size:
            raise CorruptCheckpoint(f"{name} has {f.stat().st_size} bytes, expected {want.size}")
    if checksums:
        entries = list(manifest.files.items())
        with ThreadPoolExecutor(max_workers=max(1, min(len(entries), threads or _HASH_THREADS))) as pool:
            sums = list(pool.map(lambda item: files.file_checksum(path / item[0], item[1].algorithm), entries))
        for (name, want), got in zip(entries, sums, strict=True):
            if got != want.checksum:
                raise CorruptCheckpoint(f"{name} checksum mismatch")
    return manifest
