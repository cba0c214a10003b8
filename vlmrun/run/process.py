"""Is this process alive? The one answer every liveness check of vlmrun gives.

1. A pid alone does not name a process: the kernel hands a freed pid to the next process that asks.
   So wherever a pid is recorded for later (job.json's attempts, lock.json, the reaper's argument),
   its start time is recorded with it (`start_time`: clock ticks since boot, field 22 of
   /proc/<pid>/stat), and `process_alive(pid, start)` is True only for the process that started
   then. A record without a start time (written before it was recorded) is checked by pid alone.
2. A zombie (ended, not yet reaped by its parent) is not alive: it runs nothing and holds no lock.
3. Linux, this host only: a pid recorded on another host says nothing here (callers compare hosts).
   Where /proc cannot be read (mounted with hidepid, or absent) the answer falls back to
   `kill(pid, 0)`, which cannot tell a reused pid apart.
4. For the same reason a local job is named by pid and start time (`local_job_id`): after the pids
   wrap, a new job's node may get an old one's pid, never its id.

Standard library only: the reaper (cluster/reaper.py) imports this before anything else.
"""

from __future__ import annotations

import os


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of `pid`; None when no such process exists. Raises OSError when
    /proc cannot tell (unreadable, absent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ')'
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0].decode(), int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)


def start_time(pid: int) -> int | None:
    """The start time of process `pid` of this host (clock ticks since boot); None when it does not
    exist or /proc cannot tell. Record it beside the pid, for `process_alive`."""
    try:
        stat = _stat(pid)
    except OSError:
        return None
    return stat[1] if stat is not None else None


def local_job_id(pid: int, start: int | None) -> str:
    """The job id of a local run's node process `pid` that started at `start` (`start_time(pid)`):
    `local-<pid>-<start>`, unique on this host; `local-<pid>` where /proc cannot tell the start."""
    return f"local-{pid}-{start}" if start is not None else f"local-{pid}"


def process_alive(pid: int | None, start: int | None = None) -> bool:
    """True while process `pid` of this host runs (not a zombie) and, when `start` is given, is the
    process that started at `start` (not a later one that got the same pid)."""
    if not pid or pid < 0:
        return False
    try:
        stat = _stat(pid)
    except OSError:
        return _signal_reaches(pid)
    if stat is None:
        return False
    state, started = stat
    return state not in ("Z", "X") and (start is None or started == start)


def _signal_reaches(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
