"""A data-loading process keeps the memory it frees: the next sample's buffers need no new page faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Each round mallocs three 12 MiB buffers, writes and frees them: the pattern of one sample's
# processor temporaries (numpy and torch allocate through the same malloc). glibc's default
# thresholds hand most of the freed memory back to the kernel, so every round faults thousands of
# pages in again; with the loader's settings the memory stays in the process. Raw malloc/free
# (ctypes) keeps Python's own allocations from landing between the buffers.
_ROUNDS = 10
_BUFFER = 12 << 20
_PROGRAM = """
import ctypes, json, os, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
mode, rounds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode != "default":
    from vlmrun.data.malloc import retain_freed_memory
    assert retain_freed_memory()
if mode == "forked" and os.fork():  # measured in a child forked after the setting, like a loader worker
    _, status = os.wait()
    sys.exit(os.waitstatus_to_exitcode(status))
def one_round():
    buffers = [libc.malloc(size) for _ in range(3)]
    for b in buffers:
        libc.memset(b, 1, size)
    for b in reversed(buffers):
        libc.free(b)
one_round()  # the first round grows the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds):
    one_round()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode, str(_ROUNDS), str(_BUFFER)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["faults"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_buffers_are_reused_without_page_faults():
    pages_per_buffer = _BUFFER // 4096
    default = _faults("default")
    assert default > _ROUNDS * pages_per_buffer, f"the default allocator kept its memory ({default} faults)"
    for mode in ("retain", "forked"):
        faults = _faults(mode)
        assert faults < pages_per_buffer // 10, f"{mode}: {faults} page faults in {_ROUNDS} rounds"
