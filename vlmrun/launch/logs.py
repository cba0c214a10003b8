"""`vlmrun logs`: the lines of one attempt of a run, optionally followed while the job writes.

SLURM runs: submitit writes one file per task and job id, appended across restarts; each attempt
starts with the attempt marker (run/logs.py) carrying its SLURM_RESTART_COUNT, so an attempt is the
slice between two markers. Local runs keep `logs/attempt-<N>.log`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from vlmrun.errors import InputError
from vlmrun.launch.targets import find_run
from vlmrun.launch.slurm.queries import is_live
from vlmrun.run import job as job_record
from vlmrun.run.logs import attempt_slice


def logs(target: str, attempt: int | None = None, follow: bool = False, *, poll_s: float = 1.0) -> Iterator[str]:
    """Lines of one attempt's log (default: the latest); with `follow`, new lines until the job ends."""
    rd, job_id = find_run(target)
    job = rd.read_job()
    attempts = job.get("attempts", [])
    if attempt is not None and not -len(attempts) <= attempt < len(attempts):
        raise InputError("--attempt", attempt, f"this run has attempts 0..{len(attempts) - 1}" if attempts
                         else "this run has not started an attempt yet")
    chosen = attempts[attempt if attempt is not None else -1] if attempts else {"job_id": job_id, "restart_count": 0}
    if job.get("cluster", "local") != "slurm":
        index = attempts.index(chosen) if attempts else 0
        alive = lambda: job_record.running_pid(rd.read_job()) is not None  # noqa: E731
        yield from _read_lines(rd.attempt_log(index), follow, alive, poll_s)
        return
    path = rd.task_log(chosen["job_id"])
    live = lambda: is_live(chosen["job_id"])  # noqa: E731
    lines = _read_lines(path, follow, live, poll_s)
    if attempt is None and follow:
        yield from lines
    else:
        yield from attempt_slice(lines, chosen["job_id"], int(chosen.get("restart_count", 0)))


def _read_lines(path: Path, follow: bool, alive, poll_s: float) -> Iterator[str]:
    while follow and not path.exists():
        if not alive():
            return
        time.sleep(poll_s)
    if not path.exists():
        return
    with open(path, errors="replace") as f:
        idle = 0
        while True:
            line = f.readline()
            if line:
                idle = 0
                yield line.rstrip("\n")
                continue
            if not follow:
                return
            idle += 1
            if idle > 2 and not alive():
                return
            time.sleep(poll_s)
