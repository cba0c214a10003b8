"""`vlmrun status`: what SLURM and job.json say about a run, in one record.

State comes from squeue for live jobs, then `scontrol show job` (finished jobs stay known for
MinJobAge), then sacct (absent without accounting), and job.json, which the job writes itself, for
everything else (lineage, attempts, final state). A local run is alive while its recorded pid, or the
holder of its run lock, is; one recorded RUNNING whose process is gone was KILLED.
"""

from __future__ import annotations

from vlmrun.cluster import requeue as requeue_policy
from vlmrun.launch.registry import jobs_dir
from vlmrun.launch.slurm.queries import LIVE, slurm_state
from vlmrun.launch.targets import find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import live_holder
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
    out = {
        "run_dir": str(rd.path),
        "cluster": job.cluster if job else "local",
        "job_id": job_id,
        "job_ids": list(job.job_ids) if job else [],
        "recorded_state": _value(recorded),
        "reason": (job.reason if job else None) or "",
        "attempts": len(attempts),
        "restarts": max([a.restart_count for a in attempts if a.job_id == job_id] or [0]),
        "requeues": requeue_policy.used_budget(attempts, job_id) if job_id else {},
    }
    out |= last_metrics(rd, rd.load_recipe())
    if out["cluster"] == "slurm" and job_id:
        out["slurm"] = slurm_state(job_id)
        out["state"] = _combined_state(recorded, out["slurm"])
    else:
        holder = live_holder(rd.path)  # the run lock's holder: running, even before it recorded its attempt
        pid = job_record.running_pid(job) if job else None
        pid = pid or (holder.pid if holder else None)
        out["pid"] = pid
        out["state"] = _value(State.RUNNING if pid else (State.KILLED if recorded is State.RUNNING else recorded))
    if out["state"] in (State.FAILED.value, State.KILLED.value) and recorded is State.RUNNING:
        out["reason"] = "the job ended without recording an outcome (killed?); see `vlmrun logs`"
    return out


def _combined_state(recorded: State | None, slurm: dict | None) -> str:
    """SLURM says whether the job is alive; job.json says how a finished run ended."""
    if slurm and slurm["state"] in LIVE:
        return slurm["state"]
    if recorded is None or not recorded.ended:  # the job left the queue without recording how it ended
        return slurm["state"] if slurm and slurm["state"] != "COMPLETED" else State.FAILED.value
    return recorded.value


def _value(state: State | None) -> str | None:
    return state.value if state is not None else None
