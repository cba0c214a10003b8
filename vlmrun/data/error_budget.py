"""Bad-sample budget of one loader shard: count and skip, then fail naming shard and key.

Energon calls `WorkerConfig.global_error_handler(exception, sample, sources)` for every sample that
a cooker, the task encoder or the batcher rejects, and then skips that sample. `ErrorBudget` is that
handler. It counts distinct sample keys (a bad sample met again in the next epoch is not a new
one), logs each new one with its tar file, and raises `CorruptDataError` once the count passes
`data.error_tolerance`. The keys live in shared memory (`multiprocessing.Array`), inherited by the
shard's worker processes through the fork Energon's loader always uses, so the budget is per shard,
not per worker. The error travels from the worker to the main process like any loader error, so
the run fails instead of hanging.

A sample the run cannot train on as the recipe stands (`SampleUnfit`: it does not fit
`data.max_seq_len`, has no labelled token, or its image tokens do not match its images) follows
`data.on_bad_sample`: `refuse` raises `SampleRefused` (exit 2) naming it, why and what to change;
`drop` skips it like a corrupt one, within the same budget.

Every skip is also counted in the process that made it (`take_skipped`): the task encoder's batcher
takes the count into the group it closes, so the shard counts what it dropped in stream order,
exactly as often after a restore (Energon replays the same samples to reach a saved position).

Energon's own per-stage limit of consecutive failures is switched off by the task encoder
(`__default_failure_tolerance__ = 0`), so this budget is the only one. A tar file damaged after it
was indexed (Energon's index points past its end) is not a sample error: Energon's reader raises
outside its sample error handling, and the shard fails at once naming the tar file.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from vlmrun.data.chat_encoding import SampleUnfit
from vlmrun.errors import EXIT_BAD_INPUT, CheckFailed, VlmrunError

logger = logging.getLogger(__name__)

_KEY_CHARS = 60  # a remembered key is cut to this many characters (still distinct in practice)
_KEY_BYTES = 4 * _KEY_CHARS + 1


class CorruptDataError(CheckFailed):
    """More corrupt samples than `data.error_tolerance` on one loader shard (the run fails, exit 1).

    Constructed from one message string, so torch's DataLoader can re-raise it in the main process.
    """


class SampleRefused(VlmrunError):
    """A sample the run cannot train on (`SampleUnfit`) under `data.on_bad_sample: refuse` (exit 2).

    Constructed from one message string, so torch's DataLoader can re-raise it in the main process.
    """

    exit_code = EXIT_BAD_INPUT


class ErrorBudget:
    """The error handler of one loader shard; its keys are shared with the shard's worker processes.

    `on_bad_sample` is the recipe's `data.on_bad_sample` ("refuse" or "drop").
    """

    def __init__(self, *, shard: int, num_shards: int, split: str, tolerance: int, on_bad_sample: str = "refuse"):
        self.shard, self.num_shards, self.split, self.tolerance = shard, num_shards, split, tolerance
        self.on_bad_sample = on_bad_sample
        self._keys = multiprocessing.get_context("fork").Array("c", (tolerance + 1) * _KEY_BYTES)
        self._skipped = 0  # in this process (a worker, or the shard's own) since `take_skipped`

    @property
    def label(self) -> str:
        return f"loader shard {self.shard}/{self.num_shards} ({self.split})"

    def keys(self) -> list[str]:
        """Keys of the samples skipped so far (may include samples prefetched, not yet consumed)."""
        with self._keys.get_lock():
            return _decode(self._keys.raw)

    def reset(self, keys: list[str]) -> None:
        """Remember `keys` as already skipped (a restored loader state), before the workers start."""
        with self._keys.get_lock():
            self._keys.raw = _encode(keys[: self.tolerance + 1], len(self._keys))

    def take_skipped(self) -> int:
        """Samples this process skipped since the last call (every skip, a known key's too)."""
        skipped, self._skipped = self._skipped, 0
        return skipped

    def __call__(self, error: Exception, sample: Any, sources: list | None = None) -> None:
        key, where = _where(sample, sources)
        unfit = isinstance(error, SampleUnfit)
        if unfit and self.on_bad_sample == "refuse":
            tars = _in_tars(sources).removeprefix(" in ")
            detail = str(error).removeprefix(f"{key}: ")
            raise SampleRefused(
                f"{self.label}: sample {key}{f' ({tars})' if tars else ''}: {detail}; data.on_bad_sample=refuse: "
                f"{error.remedy}, or set data.on_bad_sample=drop to skip such samples (counted, within "
                "data.error_tolerance); `vlmrun data check` lists them all"
            )
        self._skipped += 1
        what = f"dropped sample ({error.kind})" if unfit else "skipped corrupt sample"
        with self._keys.get_lock():
            keys = _decode(self._keys.raw)
            if key is not None and key[:_KEY_CHARS] in keys:
                return
            keys.append((key or f"<no key #{len(keys)}>")[:_KEY_CHARS])
            if len(keys) <= self.tolerance + 1:
                self._keys.raw = _encode(keys, len(self._keys))
        if len(keys) > self.tolerance:
            kind = "bad samples (corrupt, or unfit under data.on_bad_sample=drop)" if unfit else "corrupt samples"
            raise CorruptDataError(
                f"{self.label}: {len(keys)} {kind}, more than data.error_tolerance={self.tolerance}; "
                f"last: {where}: {type(error).__name__}: {error}"
            )
        logger.warning("%s: %s %d/%d: %s: %s", self.label, what, len(keys), self.tolerance, where, error)


def _where(sample: Any, sources: list | None) -> tuple[str | None, str]:
    """(key, 'key <key> in <tar file>') of a sample, or of the first sample of a failed batch."""
    first = sample[0] if isinstance(sample, list) and sample else sample
    key = first.get("__key__") if isinstance(first, dict) else getattr(first, "__key__", None)
    text = f"key {key}" if key else "a sample without key"
    return key, text + _in_tars(sources)


def _in_tars(sources: list | None) -> str:
    """' in <tar file>, ...' of a sample's sources ('' when Energon gave none)."""
    shards = sorted({s.shard_name for s in sources or () if getattr(s, "shard_name", None)})
    return f" in {', '.join(shards)}" if shards else ""


def _encode(keys: list[str], size: int) -> bytes:
    data = b"".join(k[:_KEY_CHARS].encode("utf-8", "replace") + b"\n" for k in keys)
    return data[:size].ljust(size, b"\0")


def _decode(raw: bytes) -> list[str]:
    return [k.decode("utf-8", "replace") for k in raw.rstrip(b"\0").split(b"\n") if k]
