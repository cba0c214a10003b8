"""The stop flag: a signal only sets it; the training loop acts on it at the next step boundary.

No I/O happens on the signal path (Megatron's DistributedSignalHandler pattern, not Lightning's save
in the handler). The controller polls `is_set()` between steps, then every rank saves together.

The node process calls `StopFlag.watch()` first thing, before it starts any process:
1. SIGUSR2, SIGTERM and SIGINT are blocked in this thread (so in every thread and child started
   later) and a watcher thread takes them with `sigtimedwait`: the flag is set the moment a signal
   arrives, whatever the main thread is doing (importing, starting Ray, waiting in `ray.wait`).
2. SIGUSR2 and SIGTERM are set to SIG_IGN, which children keep across exec, and the blocked mask is
   inherited too: a signal sent to every process of a SLURM step or to a process group never ends
   Ray's helper processes, only the node's flag is set. (Linux queues a blocked signal even when its
   disposition is SIG_IGN, so nothing is lost while we hold it.)
3. SIGINT keeps a Python handler, so `_thread.interrupt_main` (the node watchdog) still works; the
   kernel's SIGINT stays blocked here, and Ray blocks it in its own processes too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
_IGNORED_IN_CHILDREN = (signal.SIGUSR2, signal.SIGTERM)


class StopFlag:
    """Set by a stop signal (or `request()`); read at step boundaries. Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self, signals=STOP_SIGNALS) -> StopFlag:
        """Set the flag from a Python signal handler (runs in the main thread between bytecodes)."""
        for s in signals:
            signal.signal(s, self._handle)
        return self

    def watch(self) -> StopFlag:
        """Catch the stop signals from now on, at once, and keep processes started later from dying of them.

        Call from the main thread before any other thread or child process starts (see the module
        docstring). Signals already pending (a launcher starts the node with them blocked) set the flag.
        For the life of the process: nothing undoes it. A thread that already runs keeps the signals
        unblocked and may swallow one (SIG_IGN): start the process with them blocked (cluster/spawn.py).
        """
        early = _thread_count() - 1
        if early > 0 and not _blocked_at_start():
            log.warning("%d thread(s) started before the stop signals were blocked: a stop signal may be lost", early)
        sigs = set(STOP_SIGNALS)
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        self._take_pending(sigs)  # setting SIG_IGN below discards pending signals: take them first
        for s in _IGNORED_IN_CHILDREN:
            signal.signal(s, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=self._watch, args=(sigs,), daemon=True, name="vlmrun-stop-signals").start()
        return self

    def _watch(self, sigs: set) -> None:
        while True:
            self._set(signal.Signals(signal.sigwaitinfo(sigs).si_signo).name)

    def _take_pending(self, sigs: set) -> None:
        while (info := signal.sigtimedwait(sigs, 0)) is not None:
            self._set(signal.Signals(info.si_signo).name)

    def _handle(self, signum, _frame) -> None:
        self._set(signal.Signals(signum).name)

    def _set(self, name: str) -> None:
        self.signal_name = self.signal_name or name  # the first signal is the one that stopped the run
        self._event.set()

    def request(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _blocked_at_start() -> bool:
    """Whether this thread already blocks every stop signal (a launcher started us that way)."""
    return set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])


def ignore_stop_signals() -> None:
    """Ignore SIGUSR2 and SIGTERM so that helper processes started now inherit SIG_IGN.

    For payloads that start Ray without `StopFlag.watch()` (tests of the SLURM bring-up): a signal
    sent to the whole job must reach only our handler, not end Ray's daemons and workers.
    """
    for s in _IGNORED_IN_CHILDREN:
        signal.signal(s, signal.SIG_IGN)
