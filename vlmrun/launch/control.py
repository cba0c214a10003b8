"""`vlmrun cancel | requeue`: act on a running job, through the run's executor (launch/executor.py).

`requeue` asks the job to checkpoint at the next step boundary and go on in a new attempt: on SLURM
REQUEUE_REQUESTED goes into the run dir, then `scancel --signal=USR2 <jobid>` (every step, not the
batch shell), and the job requeues with the same job id (cluster/requeue.py); a local run gets SIGUSR2.
`cancel` ends the job (CANCEL_REQUESTED, then SIGTERM or `scancel`; killed after a deadline) and
records in job.json what the job could not: that `vlmrun cancel` killed it, or that it was
cancelled before it ran.
"""

from __future__ import annotations

import contextlib

from vlmrun.launch.executor import Ending, Executor
from vlmrun.launch.targets import executor_of, find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import JobRecord
from vlmrun.run.lock import RunLock, RunLocked
from vlmrun.run.state import State


def cancel(target: str, *, wait_s: float = 60.0, kill_wait_s: float = 30.0) -> dict:
    """End the run now (no requeue), wait until it has ended, and say the state it ended in.

    A running job is asked to stop (SIGTERM; on SLURM `scancel`), given `wait_s` to checkpoint and
    end, then killed (SIGKILL; `scancel --signal=KILL`). The state is what job.json says once the job
    ended: CANCELLED when it checkpointed on our request, COMPLETED or FAILED when it ended so first,
    KILLED when it ended without recording an outcome (recorded so here, saying what cancel did).
    """
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    executor = executor_of(job)
    ending = executor.cancel(rd, job, job_id, wait_s=wait_s, kill_wait_s=kill_wait_s)
    job = _settle(rd, executor, ending)
    if job is None:
        return {"run_dir": str(rd.path), "job_id": ending.job_id, "state": None}
    return {"run_dir": str(rd.path), "job_id": ending.job_id, "state": job.state.value, "reason": job.reason or ""}


def _settle(rd: RunDirectory, executor: Executor, ending: Ending) -> JobRecord | None:
    """job.json once the job ended: a job that began and did not record how it ended becomes KILLED
    with what cancel did; a queued one that never began, CANCELLED (under the run lock)."""
    job = job_record.read_job(rd)
    if job is None or ending.job_id is None:
        return job
    began = job_record.began_unrecorded(job, ending.job_id)
    if not began and job.state.ended:
        return job
    with contextlib.suppress(RunLocked), RunLock.acquire(rd.path):
        if began or not executor.queues:
            job_record.mark_killed(rd, ending.job_id, reason=ending.reason or job_record.KILLED_REASON)
        else:  # queued, or waiting to be requeued: it had nothing to stop
            job_record.set_run_state(rd, State.CANCELLED, "cancelled by `vlmrun cancel` before it ran")
    return job_record.read_job(rd)


def requeue(target: str) -> dict:
    """Ask a running job to checkpoint at the next step and requeue (same job id, restart count + 1)."""
    rd, job_id = find_run(target)
    job = job_record.read_job(rd)
    return executor_of(job).requeue(rd, job, job_id, target)
