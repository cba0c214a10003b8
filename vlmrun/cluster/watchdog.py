"""Fail fast instead of hanging: while the driver runs, a thread checks what it depends on (the nodes
of the job, the job's own servers) and ends it the moment one is gone, with one line that names it.

1. `FailFast(check, error)` calls `check()` every `period_s` on a thread of its own while the body of
   the `with` runs; `check` returns the problem as one line ("node x left the Ray cluster",
   "mooncake_master (pid 12, port 15368 on 10.0.0.1) exited with signal SIGKILL") or None. The first
   problem interrupts the main thread (a KeyboardInterrupt at its next bytecode: the driver polls Ray
   every 0.5 s), and the body ends with `error(problem)`.
2. Any other exception out of the body while something it depends on is gone becomes `error(problem)`
   too (checked once more on the way out): a call that failed because its server died, before the
   next check, is reported as that death, not as its symptom (a Mooncake key dump, a Ray traceback).
3. If the main thread has not left the body `hard_exit_s` after the interrupt (a call without a
   timeout), `on_hard_exit(reason)` runs (`reason`: the text of the error the body would have ended
   with) and the process exits with code 1.

The thread that enters the `with` must be the main thread: `interrupt_main` reaches only that one, and
only through Python's own SIGINT handler. A process started with SIGINT ignored (a background job of a
script, nohup) has none: for the body, the watchdog installs it (the node's StopFlag.watch does too)
and puts back what was there on the way out.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import threading
from collections.abc import Callable

from vlmrun.errors import VlmrunError

log = logging.getLogger(__name__)


class FailFast:
    """See the module docstring. `error` is the VlmrunError type the body ends with."""

    def __init__(
        self,
        check: Callable[[], str | None],
        error: type[VlmrunError],
        *,
        period_s: float = 1.0,
        hard_exit_s: float = 60.0,
        on_hard_exit: Callable[[str], None] | None = None,
        name: str = "vlmrun-watchdog",
    ):
        self.check, self.error = check, error
        self.period_s, self.hard_exit_s, self.on_hard_exit = period_s, hard_exit_s, on_hard_exit
        self.failure: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> FailFast:
        main = threading.current_thread() is threading.main_thread()  # only it may set a handler
        self._previous_sigint = signal.getsignal(signal.SIGINT) if main else signal.default_int_handler
        if self._previous_sigint is not signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # what interrupt_main raises through
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._lock:
            self._stop.set()
        if self._previous_sigint is not signal.default_int_handler:
            signal.signal(signal.SIGINT, self._previous_sigint)
        if exc_type is None:
            return
        problem = self.failure or self._verdict()
        if problem:
            raise self.error(problem) from (None if exc_type is KeyboardInterrupt else exc)

    def _verdict(self) -> str | None:
        """`check()`, where a check that cannot be made is no verdict (module doc)."""
        try:
            return self.check()
        except Exception as e:  # noqa: BLE001 - a check that fails to ask says nothing about what it asks
            log.debug("%s: check failed: %s: %s", self._thread.name, type(e).__name__, e)
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            problem = self._verdict()
            if not problem:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self.failure = problem
                _thread.interrupt_main()
            if not self._stop.wait(self.hard_exit_s):
                log.error("%s; the driver did not stop within %.0fs: exiting", problem, self.hard_exit_s)
                if self.on_hard_exit is not None:
                    self.on_hard_exit(str(self.error(problem)))
                os._exit(1)
            return
