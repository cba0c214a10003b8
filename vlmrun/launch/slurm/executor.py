"""SLURM as an executor (launch/executor.py): sbatch through submitit, and squeue/scontrol/sacct for the rest.

A run's jobs are SLURM jobs; a requeue keeps the job id (SLURM_RESTART_COUNT counts the attempts),
a resume adds one. The state combines SLURM's view (is the job alive?) with job.json (how did the run
end?); the logs are submitit's task logs, appended across restarts and sliced by attempt markers.
"""

from __future__ import annotations

import time

from vlmrun.errors import InputError
from vlmrun.launch.executor import AttemptLog, Ending, Executor, wait_until
from vlmrun.launch.result import SubmitResult
from vlmrun.launch.slurm.queries import LIVE, is_live, run_tool, slurm_state
from vlmrun.launch.slurm.render import render_script
from vlmrun.launch.slurm.submit import refuse_queued, resume_slurm, submit_slurm, warn_signal_delay
from vlmrun.run.directory import RunDirectory, dump_recipe
from vlmrun.run.job import JobRecord
from vlmrun.run.requests import CANCEL_REQUEST, REQUEUE_REQUEST, write_request
from vlmrun.run.state import State


class SlurmExecutor(Executor):
    """Submits the node entrypoint as a SLURM job (one task per node) and asks SLURM about it."""

    cluster = "slurm"
    runs_here = False
    queues = True

    def dry_run(self, rd: RunDirectory, recipe, *, echo=None) -> SubmitResult:
        warn_signal_delay(recipe, echo)
        return SubmitResult(
            rd.path, self.cluster, True, rendered=dump_recipe(recipe), script=render_script(rd.path, recipe)
        )

    def submit(self, rd: RunDirectory, recipe, *, wait: bool, echo=None) -> SubmitResult:
        return submit_slurm(rd, recipe, wait=wait, echo=echo)

    def resume(self, rd: RunDirectory, recipe, *, wait: bool, lock, echo=None) -> SubmitResult:
        with lock:  # released once the job is recorded, before SLURM may start it (node 0 takes it)
            return resume_slurm(rd, recipe, wait=wait, lock=lock, echo=echo)

    def refuse_while_live(self, rd: RunDirectory, job, job_id, target: str) -> None:
        refuse_queued(rd, job_id, target)

    def state(self, rd: RunDirectory, job, job_id) -> dict:
        recorded = job.state if job else None
        if not job_id:
            return {"state": recorded.value if recorded else None}
        slurm = slurm_state(job_id)
        return {"slurm": slurm, "state": combined_state(recorded, slurm)}

    def attempt_log(self, rd: RunDirectory, job, index: int, job_id) -> AttemptLog:
        attempts = job.attempts if job else []
        chosen, restart = (attempts[index].job_id, attempts[index].restart_count) if attempts else (job_id, 0)
        return AttemptLog(rd.task_log(chosen), live=lambda: is_live(chosen), marker=(chosen, restart))

    def cancel(self, rd: RunDirectory, job, job_id, *, wait_s: float, kill_wait_s: float) -> Ending:
        write_request(rd, CANCEL_REQUEST, job_id, _running_restart(job, job_id))
        t0 = time.monotonic()
        rc, _, err = run_tool(["scancel", job_id])
        if rc != 0:
            raise InputError("JOBID", job_id, message=f"scancel {job_id} failed: {err.strip()}")
        if wait_until(lambda: not is_live(job_id), wait_s):
            took = time.monotonic() - t0
            return Ending(job_id, f"ended without recording an outcome {took:.0f} s after `vlmrun cancel` ran scancel")
        run_tool(["scancel", "--signal=KILL", "--full", job_id])
        wait_until(lambda: not is_live(job_id), kill_wait_s)
        return Ending(
            job_id,
            f"killed by `vlmrun cancel` (scancel --signal=KILL): it was still in the queue {wait_s:g} s after scancel",
        )

    def requeue(self, rd: RunDirectory, job, job_id, target: str) -> dict:
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


def combined_state(recorded: State | None, slurm: dict | None) -> str:
    """SLURM says whether the job is alive; job.json says how a finished run ended."""
    if slurm and slurm["state"] in LIVE:
        return slurm["state"]
    if recorded is None or not recorded.ended:  # the job left the queue without recording how it ended
        return slurm["state"] if slurm and slurm["state"] != "COMPLETED" else State.FAILED.value
    return recorded.value


def _running_restart(job: JobRecord | None, job_id: str) -> int | None:
    """The restart count of `job_id`'s running attempt, None before its attempt has begun."""
    for a in reversed(job.attempts if job else []):
        if a.job_id == job_id and a.state is State.RUNNING:
            return a.restart_count
    return None
