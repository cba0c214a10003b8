"""A rank's host memory: kept near what is alive, and its peak measured per step.

1. glibc serves an allocation below its mmap threshold from its heap, and the threshold grows (up to
   32 MiB) as large blocks are freed. A training step allocates and frees tensors of a layer's size
   over and over (FSDP2's gathers and gradient buffers, the activations) while it keeps others of about
   that size (each layer's gradient shard): the freed blocks fragment the heap, and the process's
   resident memory ends far above what it holds (docs/measurements.md: a rank of a 692 MiB model held
   ~2.2x the model at its peak, and `malloc_trim` after the step gave back half of it, nothing live).
   `keep_near_live` fixes the thresholds for the rank's process: every block from RANK_MMAP_THRESHOLD
   up is its own mapping, handed back to the kernel when freed, and the heap's free top is trimmed
   above RANK_TRIM_THRESHOLD. RANK_MMAP_THRESHOLD is glibc's own starting threshold, held there: at
   512 KiB the blocks between the two (autograd's and the micro-batch's smaller tensors) still left
   10-30 MB a rank in the heap between micro-batches (docs/measurements.md). The cost is a page fault
   per page of every such allocation, small against a step's arithmetic; a loader's worker processes
   keep their own thresholds (data/malloc.py), which favour reuse.
2. `trim` hands back the heap's free pages after a step (`malloc_trim`), so a rollout, refit or
   checkpoint between steps starts from the memory the rank holds.
3. `StepPeak` reads the process's peak resident memory since it was last reset (VmHWM, reset through
   /proc/self/clear_refs): each step's row says that step's peak, not the process's lifetime's. Where
   the kernel offers neither (not Linux), the lifetime peak from getrusage stands in.

None of this changes a number a rank computes: only where freed memory goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import resource
from pathlib import Path

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
RANK_MMAP_THRESHOLD = 128 << 10
RANK_TRIM_THRESHOLD = 32 << 20
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def keep_near_live() -> bool:
    """Set this process's malloc thresholds for a rank (module doc); True when they were applied
    (glibc), False where the C library has no `mallopt`."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, RANK_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, RANK_TRIM_THRESHOLD)
    )
    if not applied:
        logger.debug("mallopt refused the rank's thresholds: malloc left as it is")
    return applied


def trim() -> None:
    """Hand the heap's free pages back to the kernel (glibc's `malloc_trim`; nothing elsewhere)."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def _status_mb(key: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        return None
    return None


class StepPeak:
    """This process's peak resident memory over a stretch of time (a step), in MB."""

    def reset(self) -> None:
        """Start a new stretch: the peak becomes what is resident now."""
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            pass  # not Linux, or no write access: `peak_mb` falls back to the lifetime peak

    def peak_mb(self) -> float:
        """The peak since `reset` (VmHWM), or the process's lifetime peak where /proc does not say."""
        peak = _status_mb("VmHWM")
        if peak is not None:
            return peak
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)
