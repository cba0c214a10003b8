"""The attempt log of an attempt whose console is attached: everything the console gets, copied.

A detached node writes its stdout and stderr straight into `logs/attempt-K.log`, and so does every
process it starts (Ray's workers' lines arrive through the driver). With the console attached (`submit
--wait`, `resume --wait`, and node 0 of a SLURM job, whose console is submitit's task log) the log
must hold the same lines, whoever writes them: ours, a reward function's prints, a loader worker's
"dropped sample" lines, a worker's traceback. So the node points its descriptors 1 and 2 at pipes, and
a thread copies what arrives to the console (each descriptor to where it pointed before) and to the
attempt log. Processes started later inherit the pipes and are copied alike.

1. `log_only(text)` puts a text in the log and not on the console (the traceback of a failure, which the
   console names in one line); it lands after everything written before it, which is already in a pipe.
2. `close()` (at the node's end, after its processes were swept) puts the descriptors back and copies
   what is still in the pipes. A node killed outright loses at most the lines not yet copied.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import struct
import sys
import termios
import threading
import time
from pathlib import Path

_CHUNK = 1 << 16
_DRAIN_S = 2.0  # how long `log_only` and `close` wait for the pipes to empty


class ConsoleTee:
    """Descriptors 1 and 2 of this process copied to where they pointed and to the file at `path`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._log = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # held while a chunk is copied, and while `log_only` writes
        self._pipes: list[tuple[tuple[int, ...], int, int]] = []  # (descriptors, their console, the read end)
        self._selector = selectors.DefaultSelector()
        self._flush_streams()
        # one pipe for both where they share a console (the local launcher's), so their lines keep their order
        shared = os.path.samestat(os.fstat(1), os.fstat(2))
        for fds in ((1, 2),) if shared else ((1,), (2,)):
            console = os.dup(fds[-1])
            read, write = os.pipe()
            for fd in fds:
                os.dup2(write, fd)
            os.close(write)
            self._pipes.append((fds, console, read))
            self._selector.register(read, selectors.EVENT_READ, console)
        self._closed = False
        threading.Thread(target=self._copy, name="console-tee", daemon=True).start()

    @property
    def console(self) -> int:
        """The console's descriptor of stderr (for a process that must outlive this one's copying)."""
        return self._pipes[-1][1]

    def log_only(self, text: str) -> None:
        """Append `text` to the log, after everything already written to stdout and stderr."""
        self._flush_streams()
        deadline = time.monotonic() + _DRAIN_S
        while True:
            with self._lock:
                if not self._pending() or time.monotonic() > deadline:
                    _write_all(self._log, text.encode(errors="replace"))
                    return
            time.sleep(0.001)

    def close(self) -> None:
        """Put descriptors 1 and 2 back and copy what is still in the pipes (idempotent)."""
        if self._closed:
            return
        self._flush_streams()
        for fds, console, _ in self._pipes:
            for fd in fds:
                os.dup2(console, fd)
        deadline = time.monotonic() + _DRAIN_S
        with self._lock:
            self._closed = True
            for _, console, read in self._pipes:
                while self._waiting(read) and time.monotonic() < deadline:
                    self._copy_chunk(read, console)
            for _, console, read in self._pipes:
                os.close(read)  # a process still writing gets EPIPE: its attempt is over
                os.close(console)
            os.close(self._log)

    def _copy(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(timeout=0.5):
                    with self._lock:
                        if self._closed:
                            return
                        if not self._copy_chunk(key.fd, key.data):
                            self._selector.unregister(key.fd)  # every writer is gone
        finally:
            self._selector.close()

    def _copy_chunk(self, read: int, console: int) -> bool:
        """Copy one chunk of `read` to `console` and the log; False at the end of the pipe."""
        data = os.read(read, _CHUNK)
        if not data:
            return False
        for fd in (console, self._log):
            try:
                _write_all(fd, data)
            except OSError:  # a console that went away must not stop the log, nor the run
                pass
        return True

    def _pending(self) -> bool:
        return any(self._waiting(read) for _, _, read in self._pipes)

    @staticmethod
    def _waiting(read: int) -> int:
        """Bytes waiting in the pipe `read`."""
        return struct.unpack("i", fcntl.ioctl(read, termios.FIONREAD, b"\0\0\0\0"))[0]

    @staticmethod
    def _flush_streams() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
