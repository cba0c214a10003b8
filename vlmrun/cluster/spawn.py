"""Starting a node process: the stop signals blocked from its first instruction, dying with its parent.

Why the node entrypoint always runs in a process of its own, started this way: a signal sent to a
process goes to any of its threads that does not block it. Threads that exist before
`StopFlag.watch()` blocks the stop signals keep them unblocked (OpenBLAS starts its thread pool when
numpy is imported, and submitit imports numpy before it calls us), and with SIG_IGN as the
disposition a stop signal that lands on one of them is discarded: a `scancel --signal=TERM` sent while
the node started up was lost, the run went on to the end. A process exec'd with the signals blocked
starts every thread with them blocked, so the node's watcher thread is the only one that takes them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from vlmrun.algorithms.common.stop import STOP_SIGNALS
from vlmrun.run.state import EXIT_FAILED

_PR_SET_PDEATHSIG = 1


def node_command(run_dir: str) -> list[str]:
    """The node entrypoint of `run_dir` with this interpreter."""
    return [sys.executable, "-m", "vlmrun.cluster.node", "--run-dir", str(run_dir)]


def hold_stop_signals(parent: int | None) -> None:
    """`preexec_fn` of a node process: block the stop signals (the node takes them once it runs: nothing
    sent early is lost) and, when `parent` is a pid, die with that process (PR_SET_PDEATHSIG)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    if parent is not None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(EXIT_FAILED)
