"""A stop signal reaches the node's stop flag whatever threads the process had before it blocked them.

A signal sent to a process goes to any thread that does not block it; the node ignores the stop
signals (SIG_IGN, so that Ray's processes inherit that) and takes them in one watcher thread. A thread
that existed before `StopFlag.watch()` (OpenBLAS's pool, started by `import numpy`) would swallow
them: the node is therefore always started with them blocked (cluster/spawn.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from vlmrun.cluster.spawn import hold_stop_signals

# a node-like process: threads first (numpy's BLAS pool), then the stop flag, then report the flag
NODE = """
import time, numpy
from vlmrun.algorithms.common.stop import StopFlag
flag = StopFlag().watch()
print("ready", flush=True)
flag.wait(20)
print("stopped by", flag.signal_name, flush=True)
"""
TERM_BIT = 1 << (signal.SIGTERM - 1)
USR2_BIT = 1 << (signal.SIGUSR2 - 1)


def start(blocked: bool) -> subprocess.Popen:
    env = os.environ | {"OPENBLAS_NUM_THREADS": "4"}  # a BLAS pool even on a 1-CPU machine
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, "-c", NODE],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=(lambda: hold_stop_signals(parent)) if blocked else None,
    )


def unblocked_threads(pid: int) -> list[int]:
    """Threads of `pid` that would take a SIGTERM or SIGUSR2 (the watcher, waiting for them, excepted)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = open(f"/proc/{pid}/task/{tid}/status").read()
            waiting = "sigtimedwait" in open(f"/proc/{pid}/task/{tid}/wchan").read()
        except OSError:
            continue
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if not waiting and (blocked & (TERM_BIT | USR2_BIT)) != TERM_BIT | USR2_BIT:
            found.append(int(tid))
    return found


def test_a_node_started_with_the_signals_blocked_takes_every_stop_signal():
    for signum in (signal.SIGTERM, signal.SIGUSR2, signal.SIGTERM):
        proc = start(blocked=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            for _ in range(50):  # the watcher may not have reached its wait yet
                if not (found := unblocked_threads(proc.pid)):
                    break
                time.sleep(0.05)
            assert found == []
            os.kill(proc.pid, signum)
            assert proc.stdout.readline().strip() == f"stopped by {signal.Signals(signum).name}"
        finally:
            proc.kill()
            proc.wait()


def test_threads_from_before_watch_would_take_the_signals_unblocked():
    """Why the node needs spawn.py: without it, numpy's threads keep the stop signals unblocked."""
    proc = start(blocked=False)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        assert unblocked_threads(proc.pid), "numpy started no thread before watch(): this test shows nothing"
    finally:
        proc.kill()
        proc.wait()
