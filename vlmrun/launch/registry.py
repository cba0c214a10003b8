"""The job registry: from a job id to its run directory.

A registry file per submitted job, `$VLMRUN_JOBS_DIR/<jobid>` (default `~/.cache/vlmrun/jobs/`),
holds the run dir path (each submit overwrites its id's entry; an entry whose run dir is gone or
does not list the id is ignored). launch/targets.py falls back to asking SLURM.
"""

from __future__ import annotations

import os
from pathlib import Path

from vlmrun.run.directory import RunDirectory, write_atomic
from vlmrun.run.job import read_job


def jobs_dir() -> Path:
    return Path(os.environ.get("VLMRUN_JOBS_DIR") or Path.home() / ".cache" / "vlmrun" / "jobs")


def register_job(job_id: str, run_dir: Path) -> None:
    """Remember which run dir `job_id` belongs to (for `vlmrun status|logs|cancel|requeue JOBID`)."""
    write_atomic(jobs_dir() / str(job_id), f"{Path(run_dir).resolve()}\n")


def registered_run(job_id: str) -> RunDirectory | None:
    """The run dir registered for `job_id`; None when there is none, or it is gone or no longer lists the id."""
    entry = jobs_dir() / job_id
    if not entry.is_file():
        return None
    rd = RunDirectory(entry.read_text().strip())
    job = read_job(rd) if rd.exists() else None
    return rd if job is not None and job_id in job.job_ids else None
