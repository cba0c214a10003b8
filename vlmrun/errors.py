"""Error types shared by every layer.

`InputError` is a user mistake (a recipe field, an argument, a refused resume): the CLI prints its
message in one or two lines and exits 2, with no traceback. `CheckFailed` is a check whose answer is
"no" (a diverging comparison, a failed job): exit 1. Anything else is our bug and keeps its traceback.
`NoSpaceLeft` is a write that found its file system full: it says where, what was free and what the
write needed, in the one line that job.json and the console show.
"""

from __future__ import annotations

import errno
import os
import reprlib
import shutil
import signal
from typing import Any

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


class VlmrunError(Exception):
    """Base of the errors that the CLI turns into a short message and an exit code."""

    exit_code = EXIT_CHECK_FAILED


class InputError(VlmrunError):
    """Bad input: names the field (a dotted path or an argument), the bad value and what is allowed."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, field: str, value: Any = None, allowed: str = "", *, message: str | None = None):
        self.field, self.value, self.allowed = field, value, allowed
        if message is None:
            message = f"{short_repr(field, quote=False)}: {short_repr(value)} is not allowed"
            if allowed:
                message += f"; {allowed}"
        super().__init__(message)

    def __reduce__(self):
        # pickled into another process (a Ray actor's error): rebuilt as it is, its message kept
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type, args: tuple, state: dict) -> Exception:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class StopSignalled(BaseException):
    """SIGINT, SIGTERM or SIGHUP to a command that writes files, raised from its signal handler: like
    Ctrl-C's KeyboardInterrupt no `except Exception` takes it, so every clean-up on the way out runs; the
    CLI exits 128 + `signum`."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class CheckFailed(VlmrunError):
    """The thing checked is not so (exit 1): a comparison diverged, a job failed."""


class NoSpaceLeft(OSError):
    """A write that failed for want of space (ENOSPC); its text is the one line a user reads:
    "no space left on device (<path>, <free> free, <needed> needed)". Made by `no_space_left`;
    `needed` (bytes, or None) rides along, also through pickling (a Ray actor's error)."""

    needed: int | None = None

    def __str__(self) -> str:
        return self.strerror


def no_space_left(path: str | os.PathLike, needed: int | None = None) -> NoSpaceLeft:
    """The NoSpaceLeft of a write to `path` that needed `needed` bytes (None: unknown); what is free is
    asked of `path`'s file system now."""
    free = _free_bytes(path)
    what = [f"{path}", f"{_bytes_text(free)} free" if free is not None else "free space unknown"]
    if needed is not None:
        what.append(f"{_bytes_text(needed)} needed")
    error = NoSpaceLeft(errno.ENOSPC, f"no space left on device ({', '.join(what)})", str(path))
    error.needed = needed
    return error


def disk_full(e: object) -> OSError | None:
    """The ENOSPC error behind `e`, or None: `e` itself, its cause or context, a Ray task error's
    cause, a torch.distributed.checkpoint error's failures (torch.save's own error hides the
    OSError it met in its context)."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, NoSpaceLeft) and e.strerror:
            return e
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        failures = getattr(e, "failures", None)  # DCP's: {rank: (exception, traceback)}
        for failure in failures.values() if isinstance(failures, dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) and failure else failure)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


def _free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of `path` (or of its nearest folder that exists)."""
    for where in [os.fspath(path), *_parents(os.fspath(path))]:
        try:
            return shutil.disk_usage(where).free
        except OSError:
            continue
    return None


def _parents(path: str) -> list[str]:
    out = []
    while (parent := os.path.dirname(path)) and parent != path:
        out.append(parent)
        path = parent
    return out


def _bytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _BoundedRepr(reprlib.Repr):
    """A repr that looks at a bounded prefix of a value, never at the whole of it.

    A YAML document with nested aliases is a small graph whose full repr is exponentially long, and
    an int of 5000 digits has no repr at all (Python refuses it), so neither is ever built.
    """

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 4
        self.maxset = self.maxfrozenset = self.maxdeque = 4
        self.maxstring = self.maxother = 60
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<{'-' if x < 0 else ''}integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_instance(self, x: Any, level: int) -> str:
        if isinstance(x, (str, bytes, bytearray)):  # subclasses too: cut before the repr, not after
            return reprlib.Repr.repr_str(self, x, level)
        return super().repr_instance(x, level)


_REPR = _BoundedRepr()


def short_repr(value: Any, limit: int = 80, *, quote: bool = True) -> str:
    """At most `limit` characters showing `value` (its repr; with quote=False a str shows as itself).

    Safe for any size of value: only a bounded prefix is ever formatted.
    """
    if not quote and isinstance(value, str):
        text = value[: limit + 1]
        text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    else:
        text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
