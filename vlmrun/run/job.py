"""job.json: the lineage of a run (every job id, every attempt, the final state and why).

Written atomically by whoever changes it. States: PENDING, RUNNING, COMPLETED, STOPPED (checkpointed
and resumable), FAILED, CANCELLED, REQUEUED, BUDGET_EXHAUSTED.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vlmrun.run.directory import RunDirectory

ENDED = ("COMPLETED", "STOPPED", "FAILED", "CANCELLED", "BUDGET_EXHAUSTED")

# Exit codes of the node entrypoint (and of `submit --wait` / `resume --wait`).
EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_STOPPED = 3  # checkpointed at a step boundary; `vlmrun resume` continues it


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def new_record(cluster: str, name: str) -> dict[str, Any]:
    return {"cluster": cluster, "name": name, "state": "PENDING", "created": now(), "job_ids": [], "attempts": []}


def add_job(rd: RunDirectory, job_id: str, cluster: str, name: str) -> dict[str, Any]:
    job = rd.read_job() or new_record(cluster, name)
    if job_id not in job["job_ids"]:
        job["job_ids"].append(job_id)
    job["state"] = "PENDING"
    job.setdefault("submits", []).append({"job_id": job_id, "time": now()})
    rd.write_job(job)
    return job


def begin_attempt(rd: RunDirectory, job_id: str, restart_count: int, pid: int | None = None) -> int:
    """Record the start of an attempt; returns its index (the `attempt` of metrics rows)."""
    job = rd.read_job() or new_record("local", rd.path.name)
    for a in job["attempts"]:
        if a["state"] == "RUNNING":  # an attempt that never recorded its end was killed hard
            a.update(state="KILLED", ended=a.get("ended") or now(), reason="ended without recording an outcome")
    index = len(job["attempts"])
    job["attempts"].append({"attempt": index, "job_id": job_id, "restart_count": restart_count, "pid": pid or os.getpid(),
                            "host": os.uname().nodename, "started": now(), "state": "RUNNING"})
    if job_id not in job["job_ids"]:
        job["job_ids"].append(job_id)
    job["state"] = "RUNNING"
    rd.write_job(job)
    return index


def end_attempt(rd: RunDirectory, index: int, state: str, reason: str = "", last_step: int | None = None,
                **details: Any) -> None:
    """Record an attempt's outcome; `details` (resumed_from, first_step_s, ...) are kept beside it."""
    job = rd.read_job()
    attempt = job["attempts"][index]
    attempt.update(state=state, ended=now(), reason=reason, last_step=last_step, **details)
    job["state"] = state
    job["reason"] = reason
    rd.write_job(job)


def running_pid(job: dict[str, Any]) -> int | None:
    """The pid of a local attempt still alive on this host, else None."""
    for a in reversed(job.get("attempts", [])):
        if a["state"] == "RUNNING" and a.get("host") == os.uname().nodename and _alive(a.get("pid")):
            return a["pid"]
    return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
