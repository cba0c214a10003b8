"""Readers and the run's retention never trip on each other: a checkpoint being read is not deleted.

1. A reader (export, an evaluation, the resume check) takes a shared `flock` on the checkpoint's
   manifest for as long as it reads (`shared_hold`). The lock is on the open file, so it ends with
   the reader's process, however that ends: a dead reader never pins a checkpoint.
2. Before it deletes or moves a checkpoint, the run takes an exclusive lock on the same file:
   retention does not wait (`exclusive_hold(wait=False)`: a held checkpoint is kept and deleted at a
   later save); moving a damaged one aside waits for its readers (they fail to verify it and let go).
3. A reader that got its lock after the checkpoint was moved or deleted sees that (the manifest's
   path no longer names the locked file) and tries the next checkpoint.
4. A checkpoint that retention would delete is first marked expired (`expire`: a file EXPIRED in it),
   then deleted when no reader holds it. One a reader holds stays, marked, until whoever comes next:
   the last reader as it lets go (it marks nothing, it only finishes what the run began), the run at
   its end, or a later retention. So `checkpoint.keep` holds once no reader holds a checkpoint.

Like the run lock (run/lock.py), this relies on `flock` working across the nodes that share the
checkpoint folder (local filesystems, NFS, Lustre mounted with `flock`). The exclusive side opens
the manifest for writing, which NFS needs for an exclusive lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from vlmrun.checkpoint.manifest import manifest_file

#: The mark of a checkpoint that retention would delete (module doc); an empty file in its folder.
EXPIRED = ".expired"


def expire(path: Path) -> None:
    """Mark the checkpoint folder `path` expired (before its deletion is tried: module doc)."""
    with contextlib.suppress(FileNotFoundError):
        (path / EXPIRED).touch()


def expired(path: Path) -> bool:
    """Whether the checkpoint folder `path` is marked expired."""
    return (path / EXPIRED).exists()


@contextlib.contextmanager
def shared_hold(path: Path) -> Iterator[bool]:
    """Hold the checkpoint folder `path` against deletion for the block; yields False (nothing held) when
    it is gone or has no manifest."""
    manifest = manifest_file(path)
    try:
        fd = os.open(manifest, os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield _still_there(fd, manifest)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_hold(path: Path, *, wait: bool) -> Iterator[bool]:
    """Hold `path` exclusively (no reader holds it) for the block; yields False when `wait` is False and a
    reader holds it. A folder without a manifest has no readers: True."""
    manifest = manifest_file(path)
    try:
        fd = os.open(manifest, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    except PermissionError:  # a read-only manifest: a local flock needs no write access
        fd = os.open(manifest, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            got = True
        except BlockingIOError:
            got = False
        yield got
    finally:
        os.close(fd)


def _still_there(fd: int, manifest: Path) -> bool:
    try:
        here = os.stat(manifest)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
