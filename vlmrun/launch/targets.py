"""What a user's arguments name: the run (JOBID|RUN_DIR: a run directory, a registered job id, or a job
SLURM knows) and its executor (the run's own, from job.json; `--cluster` for a new run)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.launch.executor import Executor
from vlmrun.launch.registry import jobs_dir, registered_run
from vlmrun.launch.slurm import queries
from vlmrun.launch.slurm.preflight import CONTROLLER_HINT, controller_problem
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import JobRecord, read_job

_JOB_ID = re.compile(r"^\d+(_\d+)?$")
CLUSTERS = ("auto", "slurm", "local")


def executor_for(cluster: str) -> Executor:
    """The executor of `cluster` ("local" or "slurm", as job.json spells it): the one place that maps
    the name to the executor (launch/executor.py)."""
    if cluster == "slurm":
        from vlmrun.launch.slurm.executor import SlurmExecutor

        return SlurmExecutor()
    from vlmrun.launch.local import LocalExecutor

    return LocalExecutor()


def executor_of(job: JobRecord | None) -> Executor:
    """The executor that runs the jobs of the run `job` records (a run without job.json has no job
    anywhere but, at most, a local one starting: the local executor finds it by the run lock)."""
    return executor_for(job.cluster if job is not None else "local")


def resolve_cluster(cluster: str, *, dry_run: bool = False, echo: Callable[[str], None] | None = None) -> Executor:
    """The executor `--cluster` names. `auto`: SLURM when `sbatch` is on PATH, this machine otherwise;
    a SLURM whose controller does not answer is an InputError (exit 2), never a job on this machine.
    A dry run needs no controller (it submits nothing): it shows the SLURM job, and `echo` says the
    controller does not answer now."""
    if cluster not in CLUSTERS:
        raise InputError("--cluster", cluster, f"choose one of {', '.join(CLUSTERS)}")
    if cluster != "auto":
        return executor_for(cluster)
    if not shutil.which("sbatch"):
        return executor_for("local")
    if (problem := controller_problem()) is not None:
        if dry_run:
            if echo is not None:
                echo(
                    f"# warning: --cluster auto: the SLURM controller does not answer ({problem}); this dry run "
                    "shows the SLURM job, a submit now would be refused (or use --cluster local)"
                )
            return executor_for("slurm")
        raise InputError(
            "--cluster",
            cluster,
            message=f"--cluster auto: sbatch is on PATH but the SLURM controller does not answer ({problem}); "
            f"{CONTROLLER_HINT}",
        )
    return executor_for("slurm")


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
