"""`vlmrun cancel | requeue`: act on a running job.

`requeue` writes REQUEUE_REQUESTED into the run dir, then `scancel --signal=USR2 <jobid>` (every
step, not the batch shell): the driver checkpoints at the next step boundary and the job requeues
with the same job id (cluster/requeue.py). Local runs get SIGUSR2 at the recorded pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from vlmrun.errors import InputError
from vlmrun.launch.slurm.queries import is_live, run_tool, slurm_state
from vlmrun.launch.targets import find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import JobRecord
from vlmrun.run.lock import RunLock, RunLocked, live_holder
from vlmrun.run.requests import CANCEL_REQUEST, REQUEUE_REQUEST, write_request
from vlmrun.run.state import State


def cancel(target: str, *, wait_s: float = 60.0, kill_wait_s: float = 30.0) -> dict:
    """End the run now (no requeue), wait until it has ended, and say the state it ended in.

    A running job is asked to stop (SIGTERM; on SLURM `scancel`), given `wait_s` to checkpoint and
    end, then killed (SIGKILL; `scancel --signal=KILL`). The state is what job.json says once the job
    ended: CANCELLED when it checkpointed on our request, COMPLETED or FAILED when it ended so first,
    KILLED when it ended without recording an outcome (recorded so here).
    """
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    if job is not None and job.cluster == "slurm":
        write_request(rd, CANCEL_REQUEST, job_id, _running_restart(job, job_id))
        rc, _, err = run_tool(["scancel", job_id])
        if rc != 0:
            raise InputError("JOBID", job_id, message=f"scancel {job_id} failed: {err.strip()}")
        if not _wait(lambda: not is_live(job_id), wait_s):
            run_tool(["scancel", "--signal=KILL", "--full", job_id])
            _wait(lambda: not is_live(job_id), kill_wait_s)
    elif (running := _running_local(rd, job)) is not None:
        pid, job_id = running
        write_request(rd, CANCEL_REQUEST, job_id, 0)
        _end_local(pid, wait_s, kill_wait_s)
    job = _settle(rd, job_id)
    if job is None:
        return {"run_dir": str(rd.path), "job_id": job_id, "state": None}
    return {"run_dir": str(rd.path), "job_id": job_id, "state": job.state.value, "reason": job.reason or ""}


def _running_restart(job: JobRecord, job_id: str) -> int | None:
    """The restart count of `job_id`'s running attempt, None before its attempt has begun."""
    for a in reversed(job.attempts):
        if a.job_id == job_id and a.state is State.RUNNING:
            return a.restart_count
    return None


def _running_local(rd: RunDirectory, job: JobRecord | None) -> tuple[int, str] | None:
    """(pid, job id) of the local attempt that runs in `rd` now: the run lock's live holder, or a RUNNING attempt."""
    holder = live_holder(rd.path)
    if holder is not None:
        return holder.pid, holder.job_id or f"local-{holder.pid}"
    pid = job_record.running_pid(job) if job else None
    if pid is None:
        return None
    return pid, next(a.job_id for a in reversed(job.attempts) if a.pid == pid)


def _end_local(pid: int, wait_s: float, kill_wait_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)  # the node checkpoints after the step in flight and ends
    if not _wait(lambda: not job_record.process_alive(pid), wait_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its reaper ends every process of the attempt
        _wait(lambda: not job_record.process_alive(pid), kill_wait_s)


def _wait(done, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _settle(rd: RunDirectory, job_id: str | None) -> JobRecord | None:
    """job.json once the job ended; a job that ended without recording how becomes KILLED (under the run lock)."""
    job = job_record.read_job(rd)
    if job is None or job_id is None or job.state.ended:
        return job
    began = any(a.job_id == job_id and a.state is State.RUNNING for a in job.attempts)
    with contextlib.suppress(RunLocked), RunLock.acquire(rd.path):
        if began or job.cluster == "local":
            job_record.mark_killed(rd, job_id)
        else:  # queued, or waiting to be requeued: it had nothing to stop
            job_record.set_run_state(rd, State.CANCELLED, "cancelled by `vlmrun cancel` before it ran")
    return job_record.read_job(rd)


def requeue(target: str) -> dict:
    """Ask a running job to checkpoint at the next step and requeue (same job id, restart count + 1)."""
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    if job is None or job.cluster != "slurm":
        running = _running_local(rd, job)
        if running is None:
            raise InputError("JOBID|RUN_DIR", target, message=f"{target} is not running; nothing to requeue")
        pid = running[0]
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
