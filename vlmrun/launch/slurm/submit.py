"""`vlmrun submit --cluster slurm`: check, render and submit a run with submitit; optionally wait for it.

1. Before anything is submitted: the values are safe for the script (slurm_render.check_shell_safety),
   `sbatch`/`srun`/`scontrol`/`squeue` exist, the controller answers, the recipe fits the partition
   where `sinfo` can tell (nodes, CPUs, GPUs, memory, time), multi-node runs have a run dir the nodes
   can see and nodes with addresses of their own. A misfit is an InputError naming the field (exit 2);
   nothing is submitted. So is an sbatch that fails (the controller went away, the job was refused):
   its message, in one line, exit 2.
2. `--dry-run` returns the exact sbatch script (launch/slurm/executor.py), creates and submits nothing.
3. The submitted function is `NodeEntrypoint(run_dir)` (slurm_entry.py): every node runs the node
   entrypoint in-process; node 0 decides about requeues after the driver stopped.
4. The job is submitted held (`sbatch --hold`), recorded in job.json (`add_job`) and in the job
   registry (launch/registry.py), then released: the job never races the submitter on job.json.
   `wait` polls squeue and job.json until the job has left the queue (requeues included).
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable

from vlmrun.cluster import submitit_api
from vlmrun.errors import InputError
from vlmrun.launch.registry import register_job
from vlmrun.launch.result import SubmitResult
from vlmrun.launch.slurm.preflight import CONTROLLER_HINT, preflight, signal_delay_warnings
from vlmrun.launch.slurm.queries import controller_unreachable, is_live, queue_state, run_tool, slurm_state
from vlmrun.launch.slurm.render import check_shell_safety, make_executor
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import RunLock
from vlmrun.run.metrics import last_metrics
from vlmrun.run.state import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, State

log = logging.getLogger(__name__)
_EXIT = {State.COMPLETED: EXIT_COMPLETED, State.STOPPED: EXIT_STOPPED, State.BUDGET_EXHAUSTED: EXIT_STOPPED}


def submit_slurm(
    rd: RunDirectory,
    recipe,
    *,
    wait: bool,
    echo: Callable[[str], None] | None = None,
    entrypoint: Callable[[], int] | None = None,
    poll_s: float = 2.0,
    lock: RunLock | None = None,
):
    """Submit `recipe` as a SLURM job writing into `rd` (created here when it does not exist yet).

    `entrypoint` replaces NodeEntrypoint(rd.path) (tests submit trivial payloads). Raises InputError
    before submitting anything when the run cannot work on this cluster, and when sbatch fails. `lock`,
    the run lock the caller holds, is released once the job is recorded and before SLURM may start it
    (node 0 takes it).
    """
    from vlmrun.cluster.slurm_entry import NodeEntrypoint

    say = echo or (lambda _msg: None)
    check_shell_safety(recipe, rd.path)
    warn_signal_delay(recipe, echo)
    for warning in preflight(rd.path, recipe):
        log.warning("%s", warning)
        say(f"warning: {warning}")
    if not rd.exists():
        rd.create(recipe)
    executor = make_executor(rd.path, recipe)
    try:
        job_id = submitit_api.submit_held(executor, entrypoint or NodeEntrypoint(str(rd.path)))
    except submitit_api.SbatchFailed as e:
        raise _sbatch_failed(str(e)) from None
    try:
        job_record.add_job(rd, job_id, "slurm", recipe.name)
        register_job(job_id, rd.path)
        if lock is not None:
            lock.release()
        subprocess.run(["scontrol", "release", job_id], check=True, capture_output=True, text=True, timeout=60)
    except BaseException:
        run_tool(["scancel", job_id])
        raise
    say(f"submitted job {job_id}; run dir {rd.path}\nfollow it with: vlmrun logs {job_id} -f")
    if not wait:
        return SubmitResult(rd.path, "slurm", False, job_id=job_id, state=State.PENDING.value)
    return wait_for_job(rd, job_id, echo=echo, poll_s=poll_s)


def warn_signal_delay(recipe, echo: Callable[[str], None] | None) -> None:
    """Log and echo the warnings about cluster.signal_delay_s (preflight.signal_delay_warnings)."""
    for warning in signal_delay_warnings(recipe):
        log.warning("%s", warning)
        if echo is not None:
            echo(f"warning: {warning}")


def _sbatch_failed(message: str) -> InputError:
    """sbatch's failure as bad input (exit 2): a controller it cannot reach, or a job it refused."""
    first = " ".join(message.split())
    if controller_unreachable(message):
        return InputError("--cluster", "slurm", message=f"--cluster slurm: sbatch failed: {first}; {CONTROLLER_HINT}")
    return InputError(
        "cluster",
        None,
        message=f"sbatch refused the job: {first}; check the recipe's cluster section "
        "(partition, account, qos, nodes, mem_gb, extra_sbatch_args)",
    )


def resume_slurm(rd: RunDirectory, recipe, *, wait: bool, lock: RunLock, echo: Callable[[str], None] | None = None):
    """A new SLURM job that continues the ended run in `rd` (its job id joins the run's lineage).

    Raises InputError while the run's last job is still in the queue. `lock` (the run lock, held by the
    caller) makes the check and the record one step: of two resumes at once, the second one sees the
    first one's job in job.json and in the queue.
    """
    job = job_record.read_job(rd)
    refuse_queued(rd, job.job_ids[-1] if job and job.job_ids else None, str(rd.path))
    return submit_slurm(rd, recipe, wait=wait, echo=echo, lock=lock)


def refuse_queued(rd: RunDirectory, job_id: str | None, target: str) -> None:
    """Raise InputError (naming `target`) while job `job_id` of the run is still in the queue."""
    if job_id and is_live(str(job_id)):
        raise InputError(
            "JOBID|RUN_DIR",
            target,
            message=f"job {job_id} of {rd.path} is still in the queue; "
            f"wait for it or `vlmrun cancel {job_id}` before resuming",
        )


def wait_for_job(rd: RunDirectory, job_id: str, *, echo: Callable[[str], None] | None = None, poll_s: float = 2.0):
    """Block until `job_id` has left the queue (through its requeues); the result carries job.json's outcome."""

    say = echo or (lambda _msg: None)
    recipe = rd.load_recipe()
    seen, shown_step = None, None
    try:
        while True:
            queued = queue_state(job_id)
            job = job_record.read_job(rd)
            now = (queued, job.state if job else None, len(job.attempts) if job else 0)
            if now != seen:
                say(f"job {job_id}: {queued or 'left the queue'} (run: {now[1]}, attempts {now[2]})")
                seen = now
            step = last_metrics(rd, recipe)["last_step"]
            if step is not None and step != shown_step:
                shown_step = step
                say(f"job {job_id}: step {step}")
            if queued is None:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        say(f"detached; job {job_id} keeps running: vlmrun status {job_id}")
        return SubmitResult(rd.path, "slurm", False, job_id=job_id, state=seen[0] if seen else None, exit_code=130)
    job = job_record.read_job(rd)
    state = job.state if job else None
    if state is None or not state.ended:
        slurm = slurm_state(job_id) or {}
        state = State.FAILED
        say(
            f"job {job_id} ended ({slurm.get('state', 'state unknown')}) without recording an outcome; "
            f"see {rd.task_log(job_id)}"
        )
    return SubmitResult(
        rd.path, "slurm", False, job_id=job_id, state=state.value, exit_code=_EXIT.get(state, EXIT_FAILED)
    )
