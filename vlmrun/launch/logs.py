"""`vlmrun logs`: the lines of one attempt of a run, optionally followed while the job writes.

The run's executor says where an attempt logs (launch/executor.py `attempt_log`). SLURM runs:
submitit writes one file per task and job id, appended across restarts; each attempt starts with the
attempt marker (run/logs.py) carrying its SLURM_RESTART_COUNT, so an attempt is the slice between two
markers. Local runs keep `logs/attempt-<N>.log`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.launch.targets import executor_of, find_run
from vlmrun.run import job as job_record
from vlmrun.run.logs import attempt_slice


def logs(target: str, attempt: int | None = None, follow: bool = False, *, poll_s: float = 1.0) -> Iterator[str]:
    """Lines of one attempt's log (default: the latest); with `follow`, new lines until the job ends."""
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    attempts = job.attempts if job else []
    if attempt is not None and not -len(attempts) <= attempt < len(attempts):
        raise InputError(
            "--attempt",
            attempt,
            f"this run has attempts 0..{len(attempts) - 1}" if attempts else "this run has not started an attempt yet",
        )
    index = (attempt if attempt is not None else -1) % len(attempts) if attempts else 0
    source = executor_of(job).attempt_log(rd, job, index, job_id)
    lines = _read_lines(source.path, follow, source.live, poll_s)
    if source.marker is None or (attempt is None and follow):
        yield from lines  # the file is the attempt's own, or following the job through its restarts
    else:
        yield from attempt_slice(lines, *source.marker)


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
