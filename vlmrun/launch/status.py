"""`vlmrun status`: what SLURM and job.json say about a run, in one record.

State comes from squeue for live jobs, then `scontrol show job` (finished jobs stay known for
MinJobAge), then sacct (absent without accounting), and job.json, which the job writes itself, for
everything else (lineage, attempts, final state). A local run is alive while its recorded pid is.
"""

from __future__ import annotations

from vlmrun.cluster import requeue as requeue_policy
from vlmrun.launch.registry import jobs_dir
from vlmrun.launch.targets import find_run
from vlmrun.launch.slurm.queries import LIVE, slurm_state
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import last_metrics

def status(target: str | None = None) -> dict:
    """State of one run (job id or run dir), or of the registered jobs when `target` is None."""
    if target is None:
        entries = sorted(jobs_dir().glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)[:20]
        return {"jobs": [_summary(RunDirectory(p.read_text().strip()), p.name) for p in entries
                         if RunDirectory(p.read_text().strip()).exists()]}
    rd, job_id = find_run(target)
    return _summary(rd, job_id)


def _summary(rd: RunDirectory, job_id: str | None) -> dict:
    job = rd.read_job()
    cluster = job.get("cluster", "local")
    attempts = job.get("attempts", [])
    out = {"run_dir": str(rd.path), "cluster": cluster, "job_id": job_id, "job_ids": job.get("job_ids", []),
           "recorded_state": job.get("state"), "reason": job.get("reason", ""), "attempts": len(attempts),
           "restarts": max([a.get("restart_count", 0) for a in attempts if a.get("job_id") == job_id] or [0]),
           "requeues": requeue_policy.used_budget(job, job_id) if job_id else {}}
    out |= last_metrics(rd)
    if cluster == "slurm" and job_id:
        out["slurm"] = slurm_state(job_id)
        out["state"] = _combined_state(job.get("state"), out["slurm"])
    else:
        pid = job_record.running_pid(job)
        out["pid"] = pid
        out["state"] = "RUNNING" if pid else ("FAILED" if job.get("state") == "RUNNING" else job.get("state"))
    if out["state"] != out["recorded_state"] and out["state"] == "FAILED" and job.get("state") == "RUNNING":
        out["reason"] = "the job ended without recording an outcome (killed?); see `vlmrun logs`"
    return out


def _combined_state(recorded: str | None, slurm: dict | None) -> str | None:
    """SLURM says whether the job is alive; job.json says how a finished run ended."""
    if slurm and slurm["state"] in LIVE:
        return slurm["state"]
    if recorded in ("RUNNING", "PENDING", "REQUEUED", None):
        return slurm["state"] if slurm and slurm["state"] not in ("COMPLETED",) else "FAILED"
    return recorded
