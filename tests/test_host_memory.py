"""A rank's host memory (vlmrun/policy/host_memory.py): freed blocks go back to the kernel instead of
fragmenting the heap, a step's row says that step's peak, and a loader's workers keep their own
allocator settings while the rank keeps its. The numbers on the submit path: tools/measure_rank_memory.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, /proc")

# A step's pattern in small: blocks of a layer's size (gathered weights, unsharded gradients) are freed
# while small ones allocated between them stay. A large block freed first lifts glibc's dynamic mmap
# threshold above them all, as a step's first gathers do; the heap can then return only its free top.
_PROGRAM = """
import ctypes, json, sys
from pathlib import Path
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "rank":
    from vlmrun.policy.host_memory import keep_near_live
    assert keep_near_live()
def rss_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20
big = libc.malloc(24 << 20); libc.memset(big, 1, 24 << 20); libc.free(big)
before, blocks, kept = rss_mb(), [], []
for k in range(16):
    blocks.append(libc.malloc(8 << 20)); libc.memset(blocks[-1], 1, 8 << 20)
    kept.append(libc.malloc(256 << 10)); libc.memset(kept[-1], 1, 256 << 10)
peak = rss_mb() - before
for b in blocks:
    libc.free(b)
print(json.dumps({"peak_mb": peak, "resident_mb": rss_mb() - before, "live_mb": len(kept) / 4}))
"""


def _resident(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_hands_freed_blocks_back_instead_of_holding_them():
    default, rank = _resident("default"), _resident("rank")
    assert default["peak_mb"] >= 128 and rank["peak_mb"] >= 128  # 16 blocks of 8 MiB were written
    assert default["resident_mb"] > 100, default  # the heap keeps what was freed below its top
    assert rank["resident_mb"] < 2 * rank["live_mb"] + 1, rank  # what is alive, and no more


_PEAK = """
import json
import torch
from vlmrun.policy.host_memory import StepPeak
peak = StepPeak()
peak.reset()
first = peak.peak_mb()
x = torch.ones(256 << 20, dtype=torch.uint8); del x
during = peak.peak_mb()
peak.reset()
print(json.dumps({"first": first, "during": during, "after_reset": peak.peak_mb()}))
"""


def test_a_step_peak_is_the_step_s_not_the_process_s():
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["during"] - got["first"] >= 250  # the 256 MB tensor, while it lived
    assert got["after_reset"] < got["during"] - 200  # a new stretch starts from what is resident


_WORKERS = """
import ctypes, json
import torch
from torch.utils.data import DataLoader, Dataset
from vlmrun.data.malloc import retain_freed_memory, retain_freed_memory_in_worker

class Probe(Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        retain_freed_memory_in_worker()  # what the encoders do for every sample
        return retain_freed_memory.cache_info().currsize

retain_freed_memory_in_worker()  # the rank's own process: nothing
in_worker = next(iter(DataLoader(Probe(), num_workers=1, batch_size=None, multiprocessing_context="fork")))
print(json.dumps({"main": retain_freed_memory.cache_info().currsize, "worker": int(in_worker)}))
"""


def test_a_loader_s_workers_retain_freed_memory_and_the_rank_does_not():
    out = subprocess.run([sys.executable, "-c", _WORKERS], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"main": 0, "worker": 1}
