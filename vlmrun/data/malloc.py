"""Keep freed heap memory in a data-loading process rather than handing it back to the kernel.

1. glibc serves an allocation above its mmap threshold with a fresh `mmap`, and gives the free top
   of the heap back to the kernel once it exceeds the trim threshold. Both thresholds move with
   the allocations a process happened to make first, so two identical loaders could behave
   differently depending on what ran before they forked.
2. Every sample allocates multi-MB temporaries (the image processor's float arrays), and the loader
   copies every micro-batch out of shared memory into fresh memory (`vlmrun.data.transport`). When
   that memory goes back to the kernel after each sample, the next sample faults it in again, page
   by page: a large share of a loader worker's CPU, and more of the receiving process's.
3. Fixed thresholds (32 MiB mmap, 128 MiB trim) keep that memory in the process, where the next
   sample reuses it (docs/measurements.md has the per-sample CPU before and after). The cost is that a
   process keeps up to 128 MiB of freed heap mapped instead of returning it.

`retain_freed_memory()` applies this to the calling process; processes forked later inherit it.
The encoders call `retain_freed_memory_in_worker()` for every sample, which applies it once in each
loader worker process and never in the process that trains: a rank keeps its host memory near what it
holds instead (vlmrun/policy/host_memory.py), and a loader without workers runs inside it. It does
nothing where the C library has no `mallopt` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap (glibc's largest allowed value on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept before any is returned to the kernel.
TRIM_THRESHOLD = 128 << 20


def retain_freed_memory_in_worker() -> None:
    """`retain_freed_memory()` when this process is a DataLoader worker (once: it is cached); else nothing."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        retain_freed_memory()


@functools.cache
def retain_freed_memory() -> bool:
    """Set this process's glibc malloc thresholds (see module doc); True when they were applied."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("no mallopt in %s: malloc thresholds left as they are", name)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not applied:
        logger.debug("mallopt refused the thresholds: malloc left as it is")
    return applied
