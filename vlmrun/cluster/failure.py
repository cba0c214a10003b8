"""A failure as one plain line: the root cause's type and message, and where it happened.

Ray wraps an exception raised in an actor in RayTaskError (nested once per actor it passed through),
whose text carries a traceback and ANSI colour codes; job.json and the console want the original
exception, on one line, without escapes, and the actor and node it happened on. A write that found
its disk full is said as such ("no space left on device (<path>, <free> free[, <needed> needed])"),
whatever error the library that wrote raised over it (torch.save: "unexpected pos ...").
"""

from __future__ import annotations

import re

from vlmrun.errors import NoSpaceLeft, disk_full, no_space_left

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
MAX_CHARS = 400
_HEADER = re.compile(r"ray::(?P<fn>[\w.]+)\(\)\s*\(pid=(?P<pid>\d+), ip=(?P<ip>[\w.:-]+)")
_DIED = re.compile(r"class_name: (?P<cls>\w+).*?\bpid: (?P<pid>\d+).*?\bip: (?P<ip>[\w.:-]+)", re.S)


def failure_reason(e: BaseException) -> str:
    """`Type: message (in <actor method>, pid <pid> on <node>)`, one line, at most MAX_CHARS characters.

    An actor that died (ActorDiedError) is named with its class, pid and node, from Ray's message.
    """
    where = ""
    cause: BaseException = e
    for _ in range(16):  # unwrap RayTaskError(cause=RayTaskError(cause=...)); the innermost says where
        inner = getattr(cause, "cause", None)
        if not _is_ray_task_error(cause) or inner is None:
            break
        where = _where(str(cause)) or where
        cause = inner
    text = _ANSI.sub("", str(cause))
    died = _DIED.search(text)
    if died:
        where = f"the {died['cls']} actor, pid {died['pid']} on {died['ip']}"
    elif _is_ray_task_error(cause):
        where = _where(text) or where
    message = plain(text)
    line = f"{type(cause).__name__}: {message}" if message else type(cause).__name__
    if (full := disk_full(e)) is not None:
        line = _no_space(full)
    line = f"{line} ({where})" if where else line
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."


def _no_space(error: OSError) -> str:
    if isinstance(error, NoSpaceLeft):
        return str(error)
    return str(no_space_left(error.filename)) if isinstance(error.filename, str) else "no space left on device"


def plain(text: str) -> str:
    """`text` without ANSI escapes, as one line (the first non-empty one, stripped)."""
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _is_ray_task_error(e: BaseException) -> bool:
    return type(e).__name__ == "RayTaskError" or type(e).__name__.startswith("RayTaskError(")


def _where(text: str) -> str:
    """'in SftController.run, pid 12 on 10.0.0.1' from the `ray::<method>() (pid=.., ip=..)` header of
    a RayTaskError's text; '' when it has none."""
    m = _HEADER.search(_ANSI.sub("", text))
    return f"in {m['fn']}, pid {m['pid']} on {m['ip']}" if m else ""
