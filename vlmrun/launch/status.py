"""`vlmrun status`: what the executor and job.json say about a run, in one record.

The run's executor (launch/executor.py) says whether its job is alive: on SLURM squeue for live
jobs, then `scontrol show job` (finished jobs stay known for MinJobAge), then sacct (absent without
accounting); on this machine the node process recorded by pid and start time, or the run lock's
holder. job.json, which the job writes itself, says everything else (lineage, attempts, how the run
ended and why). A run recorded RUNNING whose job is gone was KILLED. A run dir that was never
submitted says so.
"""

from __future__ import annotations

from vlmrun.cluster import requeue as requeue_policy
from vlmrun.launch.registry import jobs_dir
from vlmrun.launch.targets import executor_of, find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import last_metrics
from vlmrun.run.state import State


def status(target: str | None = None) -> dict:
    """State of one run (job id or run dir), or of the registered jobs when `target` is None."""
    if target is None:
        entries = sorted(jobs_dir().glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)[:20]
        return {
            "jobs": [
                _summary(RunDirectory(p.read_text().strip()), p.name)
                for p in entries
                if RunDirectory(p.read_text().strip()).exists()
            ]
        }
    rd, job_id = find_run(target)
    return _summary(rd, job_id)


def _summary(rd: RunDirectory, job_id: str | None) -> dict:
    job = job_record.read_job(rd)
    recorded = job.state if job else None
    attempts = job.attempts if job else []
    executor = executor_of(job)
    out = {
        "run_dir": str(rd.path),
        "cluster": executor.cluster,
        "job_id": job_id,
        "job_ids": list(job.job_ids) if job else [],
        "recorded_state": recorded.value if recorded else None,
        "reason": (job.reason if job else None) or "",
        "attempts": len(attempts),
        "restarts": max([a.restart_count for a in attempts if a.job_id == job_id] or [0]),
        "requeues": requeue_policy.used_budget(attempts, job_id) if job_id else {},
    }
    out |= last_metrics(rd, rd.load_recipe())
    out |= executor.state(rd, job, job_id)
    if out["state"] in (State.FAILED.value, State.KILLED.value) and recorded is State.RUNNING:
        out["reason"] = "the job ended without recording an outcome (killed?); see `vlmrun logs`"
    elif job is None and out["state"] is None:
        out["reason"] = (
            f"never submitted: no {rd.job_file.name} (a submit that failed before it recorded a job); "
            f"`vlmrun resume {rd.path}` starts it where `--cluster auto` would"
        )
    return out
