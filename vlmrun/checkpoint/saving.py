"""The step loop's checkpoints in flight: the loop waits for the writes, never for the disk.

1. A save's parts are written while the loop waits: every rank's, into the page cache (with
   `checkpoint.async_save` the ranks only take a copy of the policy's state and write it on a thread of
   their own). What makes the checkpoint durable and valid, the seal (every file fsynced, the manifest,
   the rename that publishes it, retention: `CheckpointStore.finish`), runs on a thread of this
   process while the next steps train. Until sealed the checkpoint is tmp_step_<N>, which no resume
   reads: a kill meanwhile leaves the previous checkpoint the newest valid one, as with async_save.
2. A save that fails (a full disk, say) leaves no partial checkpoint: its tmp_step_<N> is removed
   (`CheckpointStore.abandon`) and the checkpoints before it stay the newest valid ones.
3. One checkpoint is in flight at a time. `settle(wait=True)` waits for it (before the next save, at a
   stop, at the run's end); `settle(wait=False)`, after every step, seals an async save whose files
   are written and takes a finished seal's outcome. A seal that failed raises there, in the loop.
4. Nothing is sealed for a driver that is gone: `check_driver` runs before a seal begins, as it ran
   before the seal when the loop sealed inline; a seal already begun runs to its end.
5. `save_times`: what each save held the loop up (the writes, or async_save's copy); `write_times`:
   each checkpoint's start to its seal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from vlmrun.checkpoint.files import Digest
from vlmrun.checkpoint.manifest import RunAtSave
from vlmrun.checkpoint.write import PendingCheckpoint

log = logging.getLogger(__name__)


class Saves:
    """The checkpoint the loop has in flight (module doc). `store` seals; `check_driver` raises once the
    attempt's driver is gone."""

    def __init__(self, store, check_driver: Callable[[], None]):
        self.store, self.check_driver = store, check_driver
        self.save_times: list[float] = []
        self.write_times: list[float] = []
        self._writing: tuple | None = None  # async_save: (pending, files, run, t0, rank_files) of the one being written
        self._sealing: tuple[threading.Thread, dict] | None = None  # (thread, its outcome) of the seal under way

    def begun(
        self,
        pending: PendingCheckpoint,
        files: dict[str, Digest],
        run: RunAtSave,
        t0: float,
        rank_files: Callable[[bool], list[dict | None]] | None = None,
    ) -> None:
        """The loop wrote `files` of `pending` (begun at `t0`); `rank_files(wait)`: with async_save, the
        ranks' files once they are all written (None for a rank still writing; `wait` waits for them)."""
        self.save_times.append(round(time.perf_counter() - t0, 4))
        if rank_files is None:
            self._seal(pending, files, run, t0)
            return
        self._writing = (pending, files, run, t0, rank_files)
        log.info(
            "checkpoint of step %d: writing in the background (the step waited %.2fs)",
            pending.step,
            self.save_times[-1],
        )

    @contextlib.contextmanager
    def writing(self, pending: PendingCheckpoint) -> Iterator[None]:
        """The loop's writes of `pending`: one that fails abandons it (module doc)."""
        try:
            yield
        except BaseException as e:
            self.store.abandon(pending, e)
            raise

    def settle(self, *, wait: bool) -> None:
        """Seal an async save whose ranks are done and take a finished seal's outcome (`wait`: wait for both)."""
        if self._writing is not None:
            pending, files, run, t0, rank_files = self._writing
            try:
                written = rank_files(wait)
            except BaseException as e:
                self._writing = None
                self.store.abandon(pending, e)
                raise
            if any(w is None for w in written):
                return
            self._writing = None
            self._seal(pending, files | {f: d for w in written for f, d in w.items()}, run, t0)
        if self._sealing is None:
            return
        thread, outcome = self._sealing
        if wait:
            thread.join()
        if thread.is_alive():
            return
        self._sealing = None
        if "error" in outcome:
            raise outcome["error"]

    def close(self) -> None:
        """The loop ends, whichever way: a seal under way runs to its end (its error, if any, only logged:
        the loop's own outcome or exception is the attempt's); an async save's ranks are not waited for."""
        if self._sealing is not None:
            thread, outcome = self._sealing
            thread.join()
            self._sealing = None
            if "error" in outcome:
                log.error("checkpoint seal failed: %s", outcome["error"])

    def _seal(self, pending: PendingCheckpoint, files: dict[str, Digest], run: RunAtSave, t0: float) -> None:
        self.check_driver()
        outcome: dict = {}

        def seal() -> None:
            try:
                path = self.store.finish(pending, files, run)
            except BaseException as e:  # noqa: BLE001 - raised in the loop by `settle`
                outcome["error"] = e
                return
            self.write_times.append(round(time.perf_counter() - t0, 4))
            log.info("saved %s in %.2fs (the step waited %.2fs)", path, self.write_times[-1], self.save_times[-1])

        thread = threading.Thread(target=seal, name=f"vlmrun-seal-step-{pending.step}", daemon=True)
        thread.start()
        self._sealing = (thread, outcome)
