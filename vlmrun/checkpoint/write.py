"""Writing a checkpoint's parts: the writers' side of a checkpoint that is not sealed yet.

`PendingCheckpoint` and the policy's `PolicyWrite` are small picklable records, so they travel to the Ray
actors that write their parts (the checkpoint folder is on a filesystem every node sees). Every write
returns {file: digest} of what it wrote, hashed as the bytes went out (files.py); the store seals them
into the manifest (store.py).
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrun.checkpoint import files
from vlmrun.checkpoint.parts import DCP_METADATA, SHARDED_POLICY, PolicyState, Storage, part_file


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written (its tmp_step_<N> folder); every writer adds its parts, then the store seals it."""

    step: int
    path: str

    def write(self, part: str, state: Any, index: int | None = None) -> dict[str, files.Digest]:
        """Save `state` as `part`; returns {file: digest}. A part whose file ends in `.json` takes what
        `json` writes; the others tensors and plain containers (torch.save)."""
        name = part_file(part, index)
        target = Path(self.path) / name
        if name.endswith(".json"):
            text = json.dumps(state).encode()
            with files.space_named(target, lambda: len(text)):
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as raw:
                    hashed = files.HashingStream(raw)
                    hashed.write(text)
                    hashed.flush()
            return {name: hashed.digest()}
        import torch

        with files.space_named(target, lambda: files.state_bytes(state)):
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as raw, files.hashing_writes(raw) as hashed:
                torch.save(state, hashed)
        return {name: hashed.digest()}

    def write_policy(self, state: PolicyState, *, rank: int) -> dict[str, files.Digest]:
        """Save this rank's share of the policy; returns {file: digest} of what this rank wrote.

        One copy (`Storage.REPLICATED`): rank 0 writes every part, the other ranks nothing. Sharded: every
        rank writes its own shard through torch.distributed.checkpoint, all ranks of the process group
        together (collective); rank 0 also writes the metadata. Pieces: every rank the state names a
        writer writes its own file of each part, no collective.
        """
        return self.start_policy_write(state, rank=rank, background=False).result()

    def start_policy_write(self, state: PolicyState, *, rank: int, background: bool = True, group=None) -> PolicyWrite:
        """`write_policy` with the writing on a thread of this process (`background`): on return the
        state is copied (host memory), so the caller may change it; the files are written while it goes
        on. Sharded, the copy and the writing are DCP's `async_save`, collective over `group` (a process
        group of its own: the thread's collectives must not interleave with the training's)."""
        if state.storage is not Storage.SHARDED:
            writer = state.writer if state.storage is Storage.PIECES else (None if rank else 0)
            if writer is None:  # another rank writes the same state
                return PolicyWrite.finished({})
            if not background:
                return PolicyWrite.finished(self._write_parts(state.parts, state.storage, writer))
            staged = _host_copy(state.parts)
            return PolicyWrite.on_thread(lambda: self._write_parts(staged, state.storage, writer))
        import torch.distributed.checkpoint as dcp

        folder = Path(self.path) / SHARDED_POLICY
        folder.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(folder), thread_count=1, sync_files=False)
        writer.fs = files.hashing_file_system()  # DCP writes through `fs` (torch's fsspec writer swaps it too)

        def digests() -> dict[str, files.Digest]:
            import torch

            mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / DCP_METADATA] if rank == 0 else [])
            unhashed = [f.name for f in mine if f not in writer.fs.digests]
            if unhashed:
                raise RuntimeError(f"DCP wrote {unhashed} past the hashing stream (torch {torch.__version__})")
            return {str(f.relative_to(self.path)): writer.fs.digests[f] for f in mine}

        size = files.state_bytes(state.parts)  # now: a background write must not keep the state alive

        def needed() -> int:
            return size

        if not background:
            with files.space_named(folder, needed):
                dcp.save(state.parts, storage_writer=writer)
            return PolicyWrite.finished(digests())
        # DCP's writer stages the state into host memory (a copy) before async_save returns
        with files.space_named(folder, needed):
            written = dcp.async_save(state.parts, storage_writer=writer, process_group=group)
        future = getattr(written, "upload_completion", written)  # a Future either way
        return PolicyWrite(future, then=digests, space=(folder, needed))

    def _write_parts(self, parts: dict[str, Any], storage: Storage, writer: int) -> dict[str, files.Digest]:
        written: dict[str, files.Digest] = {}
        for part, value in parts.items():
            if storage is Storage.PIECES:
                written |= self.write(f"pieces_{part}", value, index=writer)
            else:
                written |= self.write(part, value)
        return written


class PolicyWrite:
    """A policy write in progress (`PendingCheckpoint.start_policy_write`): `done()` without waiting,
    `result()` waits and gives {file: digest}, or raises what the write raised; both may be asked again."""

    def __init__(self, future, then=None, space=None):
        self._future, self._then, self._digests = future, then, None
        self._space = space  # (folder, needed bytes) that a failure for want of space names

    @classmethod
    def finished(cls, digests: dict[str, files.Digest]) -> PolicyWrite:
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

    def result(self) -> dict[str, files.Digest]:
        if self._digests is None:
            with files.space_named(*self._space) if self._space else contextlib.nullcontext():
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
