"""`vlmrun cancel | requeue`: act on a running job.

`requeue` writes REQUEUE_REQUESTED into the run dir, then `scancel --signal=USR2 <jobid>` (every
step, not the batch shell): the driver checkpoints at the next step boundary and the job requeues
with the same job id (cluster/requeue.py). Local runs get SIGUSR2 at the recorded pid.
"""

from __future__ import annotations

import os
import signal
import time

from vlmrun.errors import InputError
from vlmrun.launch.slurm.queries import is_live, run_tool, slurm_state
from vlmrun.launch.targets import find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import JobRecord
from vlmrun.run.requests import CANCEL_REQUEST, REQUEUE_REQUEST, write_request
from vlmrun.run.state import State


def cancel(target: str, *, wait_s: float = 30.0) -> dict:
    """End the run now (no requeue); job.json says CANCELLED."""
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    if job is not None and job.cluster == "slurm":
        write_request(rd, CANCEL_REQUEST, job_id, _running_restart(job, job_id))
        rc, _, err = run_tool(["scancel", job_id])
        if rc != 0:
            raise InputError("JOBID", job_id, message=f"scancel {job_id} failed: {err.strip()}")
        deadline = time.monotonic() + wait_s
        while is_live(job_id) and time.monotonic() < deadline:
            time.sleep(0.5)
    elif job is not None and (pid := job_record.running_pid(job)):
        _end_local(pid, wait_s)
    _mark_cancelled(rd)
    return {"run_dir": str(rd.path), "job_id": job_id, "state": State.CANCELLED.value}


def _running_restart(job: JobRecord, job_id: str) -> int | None:
    """The restart count of `job_id`'s running attempt, None before its attempt has begun."""
    for a in reversed(job.attempts):
        if a.job_id == job_id and a.state is State.RUNNING:
            return a.restart_count
    return None


def _end_local(pid: int, wait_s: float) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while job_record.process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if job_record.process_alive(pid):
        os.kill(pid, signal.SIGKILL)


def _mark_cancelled(rd: RunDirectory) -> None:
    """The run and its running attempts become CANCELLED, unless the run already ended for good."""
    job = job_record.read_job(rd)
    if job is None or job.state in (State.COMPLETED, State.FAILED, State.BUDGET_EXHAUSTED):
        return
    reason = "cancelled by `vlmrun cancel`"
    for a in job.attempts:
        if a.state is State.RUNNING:
            a.state, a.ended, a.reason = State.CANCELLED, job_record.now(), reason
    job.state, job.reason = State.CANCELLED, reason
    job_record.write_job(rd, job)


def requeue(target: str) -> dict:
    """Ask a running job to checkpoint at the next step and requeue (same job id, restart count + 1)."""
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    if job is None or job.cluster != "slurm":
        pid = job_record.running_pid(job) if job else None
        if not pid:
            raise InputError("JOBID|RUN_DIR", target, message=f"{target} is not running; nothing to requeue")
        os.kill(pid, signal.SIGUSR2)
        return {"run_dir": str(rd.path), "job_id": job_id, "signalled": "SIGUSR2", "pid": pid}
    state = (slurm_state(job_id) or {}).get("state")
    if state != State.RUNNING.value:
        raise InputError(
            "JOBID",
            job_id,
            message=f"job {job_id} is {state or 'not known to SLURM'}; only a RUNNING job can checkpoint and requeue",
        )
    write_request(rd, REQUEUE_REQUEST, job_id, _running_restart(job, job_id))
    rc, _, err = run_tool(["scancel", "--signal=USR2", job_id])
    if rc != 0:
        (rd.path / REQUEUE_REQUEST).unlink(missing_ok=True)
        raise InputError("JOBID", job_id, message=f"scancel --signal=USR2 {job_id} failed: {err.strip()}")
    return {"run_dir": str(rd.path), "job_id": job_id, "signalled": "SIGUSR2"}
