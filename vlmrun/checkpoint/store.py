"""The checkpoint store: one run's checkpoints in one folder; the one owner of the folder's layout.

    checkpoints/owner.json                the run this folder belongs to (owner.py)
    checkpoints/tmp_step_<N>/             being written (ignored, and removed by the next save)
    checkpoints/damaged_step_<N>-<time>/  a checkpoint found damaged, moved aside for inspection
    checkpoints/step_<N>/                 complete: manifest.json (manifest.py) and the parts (parts.py)

1. `begin` gives the writers a fresh tmp_step_<N>; `finish` seals it (the manifest names the run that
   wrote it), renames it to step_<N> and applies retention. A save that fails is `abandon`ed: its
   tmp_step_<N> goes, and for want of space the error names this folder, what is free, what a
   checkpoint of the run takes.
2. Only this run's checkpoints count (owner.py): the store lists, loads and deletes no
   other run's, and `claim` / `check_owner` refuse a folder that belongs to another run.
3. Only valid checkpoints count. `latest` returns the newest that verifies; the job, the run's one
   writer (`set_aside=True`), moves a damaged one aside to damaged_step_<N>-<time> (kept for
   inspection, never counted again), so the step it held is saved again. Retention keeps the newest
   `keep` valid ones and never deletes a valid one for a damaged one.
4. Re-hashing costs a full read of the checkpoint (GBs at scale), so a store re-hashes a checkpoint
   at most once: one it sealed or verified counts as valid after a stat of each file (`holds`); the
   job's controller takes the node's verification as its own (`mark_verified`).
5. Readers in other processes (`reading`: export, an evaluation) hold the checkpoint they read, so
   the run's retention cannot delete it under them (lease.py); one that vanished between
   the listing and the hold gives way to the next valid one. One that retention had to leave to a
   reader is marked expired and deleted once nobody holds it: by the last reader as it lets go, by
   the run at its end (`delete_expired`), or by a later retention.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from vlmrun.checkpoint.files import Digest, fsync_dir
from vlmrun.checkpoint.lease import exclusive_hold, expire, expired, shared_hold
from vlmrun.checkpoint.manifest import FORMAT, CorruptCheckpoint, Manifest, RunAtSave, read_manifest, seal
from vlmrun.checkpoint.owner import CheckpointOwner, check_folder, claim_folder, release_claim
from vlmrun.checkpoint.parts import lacking_parts
from vlmrun.checkpoint.read import Checkpoint, verify
from vlmrun.checkpoint.write import PendingCheckpoint
from vlmrun.errors import disk_full, no_space_left
from vlmrun.run.directory import RunDirectory

log = logging.getLogger(__name__)

_READ_ROUNDS = 100  # listings a reader tries while each one it listed was deleted before it held it
_EMPTY_LISTINGS = 3  # of those, how many may come back empty before the store counts as empty


class MissingCheckpoint(LookupError):
    """No checkpoint to read: none of the step asked for, or none that verifies (`skipped` says why)."""

    def __init__(self, message: str, skipped: list[str] | None = None):
        super().__init__(message)
        self.skipped = skipped or []


def run_checkpoints(rd: RunDirectory, recipe, *, assign: bool = True) -> CheckpointStore:
    """The store of the run in `rd`: checkpoint.dir (default <run dir>/checkpoints), checkpoint.keep, and
    the run's id (`assign`: give a run directory from before run ids its id now; readers pass False)."""
    return CheckpointStore(rd.checkpoints(recipe), recipe.checkpoint.keep, CheckpointOwner.of(rd, assign=assign))


class CheckpointStore:
    """The checkpoints of one run under `root`; the newest `keep` valid ones are retained.

    Without an `owner` every checkpoint in `root` counts (tools and tests); a run's store has one.
    """

    def __init__(self, root: Path, keep: int, owner: CheckpointOwner | None = None):
        self.root, self.keep, self.owner = Path(root), keep, owner
        self._valid: dict[int, Path] = {}  # step -> folder this store sealed or verified

    # ---- whose checkpoints ------------------------------------------------------------------------
    def check_owner(self) -> None:
        """Raise ForeignCheckpoints (InputError on checkpoint.dir, exit 2) when the folder is another run's."""
        if self.owner is not None:
            check_folder(self.root, self.owner, {path: manifest for _, path, manifest in self._sealed()})

    def claim(self) -> bool:
        """Take the folder for this run (owner.json, created with the folder); True when this call wrote
        the claim. ForeignCheckpoints when it is another run's, also when that run claimed it a moment ago."""
        if self.owner is None:
            return False
        self.check_owner()
        return claim_folder(self.root, self.owner)

    def release_claim(self) -> None:
        """Withdraw this run's claim (a submit that failed before its run directory came to be)."""
        if self.owner is not None:
            release_claim(self.root, self.owner)

    # ---- writing ----------------------------------------------------------------------------------
    def begin(self, step: int) -> PendingCheckpoint:
        """A fresh, empty tmp_step_<N> folder for the writers."""
        tmp = self.root / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return PendingCheckpoint(step, str(tmp))

    def finish(self, pending: PendingCheckpoint, files: dict[str, Digest], run: RunAtSave | None) -> Path:
        """Seal `pending` ({file: digest} from the writers into the manifest, with `run` (None: a tool's
        checkpoint, which no run resumes) and the run that wrote it; fsync) and rename it to step_<N>;
        apply retention."""
        tmp = Path(pending.path)
        missing = lacking_parts(files)
        if missing:
            raise ValueError(f"checkpoint step {pending.step} lacks the parts {missing}")
        stamp = self.owner.stamp() if self.owner is not None else {}
        entries = {f: files[f] for f in sorted(files)}
        try:
            seal(tmp, Manifest(FORMAT, pending.step, entries, run, saved_at=time.time(), **stamp))
        except BaseException as e:
            self.abandon(pending, e)
            raise
        final = self.root / f"step_{pending.step}"
        if final.exists():
            self._replace(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._valid[pending.step] = final
        self._retain()
        return final

    def abandon(self, pending: PendingCheckpoint, error: BaseException) -> None:
        """A save of `pending` that failed with `error` (the caller re-raises it): its tmp_step_<N> goes,
        so the checkpoints before it stay the newest valid ones. For want of space, raises instead a
        NoSpaceLeft naming this folder, what is free once the partial checkpoint is gone, and what a
        checkpoint of this run takes (its newest one; for its first, what was written plus what the
        failed write needed)."""
        tmp = Path(pending.path)
        found = disk_full(error)
        written = _bytes_under(tmp) if found is not None else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if found is None:
            return
        needed = self._checkpoint_bytes() or written + (getattr(found, "needed", None) or 0) or None
        full = no_space_left(self.root, needed)
        log.error("checkpoint of step %d not saved: %s; removed %s", pending.step, full, tmp.name)
        raise full from error

    def _checkpoint_bytes(self) -> int | None:
        """The size of this run's newest sealed checkpoint (its manifest's files), None when there is none."""
        newest = self.newest_manifest()
        return sum(d.size for d in newest[1].files.values()) if newest is not None else None

    # ---- reading ----------------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of this run's sealed checkpoints, oldest first (not verified)."""
        return [(s, p) for s, p, m in self._sealed() if self.owner is None or self.owner.owns(m)]

    def holds(self, step: int) -> bool:
        """Whether a checkpoint of `step` that this store sealed or verified is still whole: in place,
        every listed file at its size (a stat each, no re-hash)."""
        path = self._valid.get(step)
        if path is None:
            return False
        try:
            verify(path, checksums=False)
        except CorruptCheckpoint:
            del self._valid[step]
            return False
        return True

    def mark_verified(self, checkpoint: Checkpoint) -> None:
        """Count `checkpoint` (verified by another process of the run: the node) as valid, unread."""
        self._valid[checkpoint.step] = checkpoint.path

    def latest(self, *, set_aside: bool = False, checksums: bool = True) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint of this run that verifies, and a line for each newer, damaged one.

        `set_aside`: move the damaged ones aside (only the run's job, its one writer, does).
        `checksums=False`: every file present at its size is enough (a stat each): the candidate a job
        starts from while `verify_candidate` hashes it. Raises ForeignCheckpoints when the folder is
        another run's.
        """
        self.check_owner()
        skipped = []
        for step, path in reversed(self.complete()):
            try:
                manifest = verify(path, checksums=checksums)
            except CorruptCheckpoint as e:
                skipped.append(self._skip(path, e, set_aside=set_aside))
                continue
            if checksums:
                self._valid[step] = path
            return Checkpoint(step, path, manifest), skipped
        return None, skipped

    def verify_candidate(self, candidate: Checkpoint) -> tuple[Checkpoint | None, list[str]]:
        """`candidate` (from `latest(checksums=False)`) once its files hash to their recorded sums;
        damaged, it is moved aside and the newest older one that verifies is taken instead (a line for
        each damaged one)."""
        try:
            verify(candidate.path)
        except CorruptCheckpoint as e:
            skipped = [self._skip(candidate.path, e, set_aside=True)]
            found, more = self.latest(set_aside=True)
            return found, skipped + more
        self._valid[candidate.step] = candidate.path
        return candidate, []

    def newest_manifest(self) -> tuple[int, Manifest] | None:
        """(step, manifest) of this run's newest sealed checkpoint, read without verifying its files
        (cheap: for checks on a login node); None when there is none with a readable manifest."""
        for step, path in reversed(self.complete()):
            try:
                return step, read_manifest(path)
            except CorruptCheckpoint:
                continue
        return None

    @contextlib.contextmanager
    def reading(self, step: int | None = None) -> Iterator[tuple[Checkpoint, list[str]]]:
        """(checkpoint, skipped) for a reader beside a run that may be training: the newest checkpoint
        that verifies, or that of `step`, held for the block so the run's retention cannot delete it.

        `skipped` names the newer, damaged ones (a reader moves nothing). Raises MissingCheckpoint
        (none of `step`, or none valid), CorruptCheckpoint (`step`'s does not verify),
        ForeignCheckpoints (the folder is another run's).
        """
        self.check_owner()
        skipped: list[str] = []
        for round_ in range(_READ_ROUNDS):
            listed = [(s, p) for s, p in reversed(self.complete()) if step in (None, s)]
            # a listing beside the run's renames may miss every entry (readdir): look again, briefly
            vanished = not listed and round_ < _EMPTY_LISTINGS
            if vanished:
                time.sleep(0.01)
            for s, path in listed:
                with self._reader_hold(path) as held:
                    try:
                        manifest = verify(path)
                    except CorruptCheckpoint as e:
                        if not held and not path.exists():  # deleted or moved since the listing: the next one
                            vanished = True
                            continue
                        if step is not None:
                            raise
                        if (line := f"skipped {path.name}: {e}") not in skipped:
                            skipped.append(line)
                        continue
                    if not held:  # sealed again under the same name since the listing: list anew
                        vanished = True
                        continue
                    yield Checkpoint(s, path, manifest), skipped
                    return
            if not vanished:
                break
        what = f"no checkpoint of step {step}" if step is not None else "no valid checkpoint"
        raise MissingCheckpoint(f"{what} in {self.root}", skipped)

    @contextlib.contextmanager
    def _reader_hold(self, path: Path) -> Iterator[bool]:
        """A reader's hold on `path` (lease.shared_hold); letting go of one marked expired deletes it
        unless another reader holds it still (that one does, later)."""
        try:
            with shared_hold(path) as held:
                yield held
        finally:
            if expired(path):
                try:
                    self._delete(path, wait=False)
                except OSError as e:  # a reader that may not write (a read-only mount) leaves it to the run
                    log.info("left %s, expired, in place: %s", path, e)

    def delete_expired(self) -> None:
        """Delete the checkpoints that retention marked expired while a reader held them and that no
        reader holds now (the run's end); one still held stays, for its last reader to delete."""
        for _, path in self.complete():
            if expired(path):
                try:
                    self._delete(path, wait=False)
                except OSError as e:  # tidying up never fails the run that trained
                    log.warning("could not delete %s, expired: %s", path, e)

    # ---- retention and damage -----------------------------------------------------------------------
    def _sealed(self) -> list[tuple[int, Path, Manifest | None]]:
        """(step, folder, manifest or None when unreadable) of every step_<N> in the folder, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            if p.name.startswith("step_") and p.name[5:].isdigit() and p.is_dir():
                try:
                    manifest = read_manifest(p)
                except (CorruptCheckpoint, OSError):
                    manifest = None
                found.append((int(p.name[5:]), p, manifest))
        return sorted(found, key=lambda f: f[0])

    def _retain(self) -> None:
        """Keep the newest `keep` valid checkpoints; delete the older ones that no reader holds now (a
        held one goes at a later save); move damaged ones aside."""
        for junk in [*self.root.glob("tmp_step_*"), *self.root.glob(".deleting_*")]:
            shutil.rmtree(junk, ignore_errors=True)
        kept = 0
        for step, path in reversed(self.complete()):
            if kept < self.keep:
                kept += self._counts(step, path)
            else:
                expire(path)  # first: a reader that lets go after the try below then deletes it
                self._delete(path, wait=False)

    def _counts(self, step: int, path: Path) -> bool:
        if self.holds(step):
            return True
        try:
            verify(path)
        except CorruptCheckpoint as e:
            if path.exists():  # else deleted meanwhile: an expired one, by its last reader (lease.py)
                self._skip(path, e, set_aside=True, wait=False)  # the training loop never waits on a reader
            return False
        self._valid[step] = path
        return True

    def _skip(self, path: Path, error: CorruptCheckpoint, *, set_aside: bool, wait: bool = True) -> str:
        """The line that reports a damaged checkpoint; with `set_aside`, it is moved aside first: at once
        when `wait` is False and a reader holds it, it stays (not counted) until a later look."""
        line = f"skipped {path.name}: {error}"
        if set_aside:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside, n = path.with_name(f"damaged_{path.name}-{stamp}"), 1
            while aside.exists():
                aside, n = path.with_name(f"damaged_{path.name}-{stamp}.{n}"), n + 1
            with exclusive_hold(path, wait=wait) as free:  # its readers fail to verify it and let go
                if free:
                    with contextlib.suppress(FileNotFoundError):  # gone meanwhile: deleted, expired (lease.py)
                        os.rename(path, aside)
                        line += f"; moved aside to {aside.name}"
            self._valid.pop(int(path.name[5:]), None)
        log.warning("%s (in %s)", line, self.root)
        return line

    def _delete(self, path: Path, *, wait: bool) -> None:
        with exclusive_hold(path, wait=wait) as free:
            if not free:
                log.info("keeping %s beyond checkpoint.keep for now: a reader holds it", path)
                return
            doomed = path.with_name(f".deleting_{path.name}-{os.getpid()}")
            try:
                os.rename(path, doomed)  # out of every listing at once; the files go after the lock
            except FileNotFoundError:  # deleted meanwhile by another (its last reader, lease.py)
                return
        self._valid.pop(int(path.name[5:]), None)
        shutil.rmtree(doomed, ignore_errors=True)

    def _replace(self, final: Path) -> None:
        """A sealed step_<N> where a new one of the same step is about to go: it must be this run's."""
        try:
            manifest = read_manifest(final)
        except CorruptCheckpoint:
            manifest = None
        if self.owner is not None and not self.owner.owns(manifest):
            raise RuntimeError(f"{final} belongs to another run; a run never replaces another run's checkpoint")
        self._delete(final, wait=True)


def _bytes_under(folder: Path) -> int:
    """What the files under `folder` take (0 when it is gone)."""
    total = 0
    for p in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total
