"""Corrupt-sample budget of one loader shard: count and skip, then fail naming shard and key.

Energon calls `WorkerConfig.global_error_handler(exception, sample, sources)` for every sample that
a cooker, the task encoder or the batcher rejects, and then skips that sample. `ErrorBudget` is that
handler: it logs the sample's key and tar file, adds one to a counter shared by the shard's worker
processes (a `multiprocessing.Value`, inherited through the fork Energon's loader always uses), and
raises `CorruptDataError` once the count passes `data.error_tolerance`. The error travels from the
worker to the main process like any loader error, so the run fails instead of hanging.

Energon's own per-stage limit of consecutive failures is switched off by the task encoder
(`__default_failure_tolerance__ = 0`), so this budget is the only one. Errors raised while reading a
tar file itself (a header Energon's index does not match) are not sample errors: they fail at once.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from vlmrun.errors import CheckFailed

logger = logging.getLogger(__name__)


class CorruptDataError(CheckFailed):
    """More corrupt samples than `data.error_tolerance` on one loader shard (the run fails, exit 1).

    Constructed from one message string, so torch's DataLoader can re-raise it in the main process.
    """


class ErrorBudget:
    """The error handler of one loader shard; `count` is shared with the shard's worker processes."""

    def __init__(self, *, shard: int, num_shards: int, split: str, tolerance: int, already_seen: int = 0):
        self.shard, self.num_shards, self.split, self.tolerance = shard, num_shards, split, tolerance
        self._count = multiprocessing.get_context("fork").Value("q", already_seen)

    @property
    def count(self) -> int:
        """Corrupt samples skipped so far (may include samples prefetched but not yet consumed)."""
        return int(self._count.value)

    def reset(self, count: int) -> None:
        """Set the count (used when a saved loader state is restored, before the workers start)."""
        self._count.value = count

    def __call__(self, error: Exception, sample: Any, sources: list | None = None) -> None:
        where = _where(sample, sources)
        with self._count.get_lock():
            self._count.value += 1
            count = self._count.value
        label = f"loader shard {self.shard}/{self.num_shards} ({self.split})"
        if count > self.tolerance:
            raise CorruptDataError(
                f"{label}: {count} corrupt samples, more than data.error_tolerance={self.tolerance}; "
                f"last: {where}: {type(error).__name__}: {error}"
            )
        logger.warning("%s: skipped corrupt sample %d/%d: %s: %s", label, count, self.tolerance, where, error)


def _where(sample: Any, sources: list | None) -> str:
    """'key <key> in <tar file>' of a sample (or of the first sample of a failed batch)."""
    first = sample[0] if isinstance(sample, list) and sample else sample
    key = first.get("__key__") if isinstance(first, dict) else getattr(first, "__key__", None)
    shards = sorted({s.shard_name for s in sources or () if getattr(s, "shard_name", None)})
    text = f"key {key}" if key else "a sample without key"
    return f"{text} in {', '.join(shards)}" if shards else text
