"""What a user's JOBID|RUN_DIR argument names: a run directory, a registered job id, or a job SLURM knows."""

from __future__ import annotations

import re
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.launch.registry import jobs_dir, registered_run
from vlmrun.launch.slurm import queries
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import read_job

_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def find_run(target: str) -> tuple[RunDirectory, str | None]:
    """(run dir, job id) for a job id or a run dir; raises InputError naming what was tried."""
    path = Path(target).expanduser()
    if path.is_dir():
        rd = RunDirectory(path)
        if not rd.exists():
            raise InputError(
                "JOBID|RUN_DIR", target, message=f"{target} is not a vlmrun run directory (no recipe.yaml)"
            )
        job = read_job(rd)
        return rd, job.job_ids[-1] if job and job.job_ids else None
    rd = registered_run(target)
    if rd is not None:
        return rd, target
    if _JOB_ID.match(target):
        found = _run_dir_from_scontrol(target)
        if found:
            return found, target
    raise InputError(
        "JOBID|RUN_DIR",
        target,
        message=f"{target}: neither a run directory nor a job id known to vlmrun (registry {jobs_dir()}) or to SLURM",
    )


def _run_dir_from_scontrol(job_id: str) -> RunDirectory | None:
    info = queries.parse_scontrol_job(queries.run_tool(["scontrol", "show", "job", "-o", job_id])[1])
    out = info.get("StdOut", "")
    if "/submitit/" in out:
        rd = RunDirectory(out.rsplit("/submitit/", 1)[0])
        return rd if rd.exists() else None
    return None
