"""The stop flag: a signal only sets it; the training loop acts on it at the next step boundary.

No I/O happens in the handler (Megatron's DistributedSignalHandler pattern, not Lightning's save in
the handler). The controller polls `is_set()` between steps, then every rank saves together.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopFlag:
    """Set by SIGUSR2/SIGTERM (or `request()`); read at step boundaries. Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self, signals=STOP_SIGNALS) -> StopFlag:
        for s in signals:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def request(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def ignore_stop_signals() -> None:
    """Ignore the stop signals so that helper processes started now (Ray's) inherit SIG_IGN.

    A signal sent to the whole process group (SLURM's time-limit USR2, `kill -USR2 -PGID`) must reach
    only our handler, not kill Ray's daemons and workers, whose default action for USR2 is to exit.
    """
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
