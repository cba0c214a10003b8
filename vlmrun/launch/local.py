"""The embedded default: run the node entrypoint on this machine, no SLURM.

The same entrypoint that every SLURM node runs (`python -m vlmrun.cluster.node`) runs here as a child
process, in a session of its own, so a Ctrl-C in the terminal reaches only us and never Ray's helper
processes. It starts with the stop signals blocked (it takes them once it runs: nothing sent early is
lost) and inherits the run lock, which the caller took before its first write into the run dir. It
begins its attempt only once we have recorded the job in job.json (a pipe we close then).

With `wait`, the child dies with us (PR_SET_PDEATHSIG) and we pass SIGINT/SIGTERM/SIGUSR2 on to it:
the first Ctrl-C stops the run at a checkpoint, a second one kills it hard (saying, and recording in
job.json, whether that checkpoint was sealed already). Without `wait`, it runs detached and logs to the
run dir.

`LocalExecutor` is this machine as an executor (launch/executor.py): the job is the node process,
found as the run lock's live holder or the RUNNING attempt of job.json, by pid and start time; cancel
sends it SIGTERM (SIGKILL after the deadline), requeue SIGUSR2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from vlmrun.algorithms.common.stop import STOP_SIGNALS
from vlmrun.cluster.failure import failure_reason
from vlmrun.cluster.node import RECORDED_FD_ENV
from vlmrun.cluster.spawn import hold_stop_signals, node_command
from vlmrun.errors import EXIT_BAD_INPUT, InputError
from vlmrun.launch.executor import AttemptLog, Ending, Executor, wait_until
from vlmrun.launch.registry import register_job
from vlmrun.launch.result import SubmitResult
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory, dump_recipe
from vlmrun.run.job import JobRecord
from vlmrun.run.lock import FD_ENV, Holder, RunLock, RunLocked, live_holder
from vlmrun.run.process import local_job_id, process_alive, start_time
from vlmrun.run.requests import CANCEL_REQUEST, write_request
from vlmrun.run.state import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, State

EXIT_INTERRUPTED = 130  # killed hard by a second Ctrl-C


class LocalExecutor(Executor):
    """Runs the node entrypoint as a child process of this machine (the embedded default)."""

    cluster = "local"
    runs_here = True
    queues = False

    def dry_run(self, rd: RunDirectory, recipe, *, echo=None) -> SubmitResult:
        return SubmitResult(rd.path, self.cluster, True, rendered=dump_recipe(recipe))

    def submit(self, rd: RunDirectory, recipe, *, wait: bool, echo=None) -> SubmitResult:
        lock = RunLock.acquire(rd.path)  # before our first write: one attempt per run dir (exit 2 naming the holder)
        try:
            rd.create(recipe)
        except BaseException:
            lock.release()
            raise
        return start_local(rd, recipe, wait=wait, lock=lock, echo=echo)

    def resume(self, rd: RunDirectory, recipe, *, wait: bool, lock: RunLock, echo=None) -> SubmitResult:
        return start_local(rd, recipe, wait=wait, lock=lock, echo=echo)

    def refuse_while_live(self, rd: RunDirectory, job, job_id, target: str) -> None:
        if (holder := live_holder(rd.path)) is not None:
            raise RunLocked(rd.path, holder)  # names the holder: pid, host, job id, how to cancel it
        if (attempt := job_record.running_attempt(job) if job else None) is not None:
            raise InputError(
                "RUN_DIR", target, message=f"{target} is still running (pid {attempt.pid}); stop it before resuming"
            )

    def state(self, rd: RunDirectory, job, job_id) -> dict:
        node = running_node(rd, job)
        recorded = job.state if job else None
        state = State.RUNNING if node else (State.KILLED if recorded is State.RUNNING else recorded)
        return {"pid": node.pid if node else None, "state": state.value if state else None}

    def attempt_log(self, rd: RunDirectory, job, index: int, job_id) -> AttemptLog:
        return AttemptLog(rd.attempt_log(index), live=lambda: running_node(rd, job_record.read_job(rd)) is not None)

    def cancel(self, rd: RunDirectory, job, job_id, *, wait_s: float, kill_wait_s: float) -> Ending:
        node = running_node(rd, job)
        if node is None:
            return Ending(job_id)
        write_request(rd, CANCEL_REQUEST, node.job_id, 0)
        t0 = time.monotonic()
        node.signal(signal.SIGTERM)  # the node checkpoints after the step in flight and ends
        if wait_until(lambda: not node.alive(), wait_s):
            took = time.monotonic() - t0
            return Ending(
                node.job_id, f"ended without recording an outcome {took:.0f} s after `vlmrun cancel` sent SIGTERM"
            )
        node.signal(signal.SIGKILL)  # its reaper ends every process of the attempt
        wait_until(lambda: not node.alive(), kill_wait_s)
        return Ending(node.job_id, f"killed by `vlmrun cancel` (SIGKILL): it had not ended {wait_s:g} s after SIGTERM")

    def requeue(self, rd: RunDirectory, job, job_id, target: str) -> dict:
        node = running_node(rd, job)
        if node is None or not node.signal(signal.SIGUSR2):
            raise InputError("JOBID|RUN_DIR", target, message=f"{target} is not running; nothing to requeue")
        return {"run_dir": str(rd.path), "job_id": job_id, "signalled": "SIGUSR2", "pid": node.pid}


@dataclass(frozen=True)
class RunningNode:
    """The node process of the local attempt that runs now: pid and start time (a reused pid is not it)."""

    pid: int
    start: int | None
    job_id: str

    def alive(self) -> bool:
        return process_alive(self.pid, self.start)

    def signal(self, signum: int) -> bool:
        """Send `signum` when the process is still the one recorded; whether it was sent."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True


def running_node(rd: RunDirectory, job: JobRecord | None) -> RunningNode | None:
    """The local attempt that runs in `rd` now: the run lock's live holder (also before it recorded its
    attempt), or an attempt job.json records RUNNING on this host whose process still runs."""
    if (holder := live_holder(rd.path)) is not None:
        return RunningNode(holder.pid, holder.start, holder.job_id or local_job_id(holder.pid, holder.start))
    attempt = job_record.running_attempt(job) if job else None
    return RunningNode(attempt.pid, attempt.pid_start, attempt.job_id) if attempt else None


def start_local(
    rd: RunDirectory, recipe, *, wait: bool, lock: RunLock, echo: Callable[[str], None] | None = None
) -> SubmitResult:
    """Start the node entrypoint for `rd`; `lock` is the run lock the caller holds (handed to the node, then released here)."""
    with lock:
        attempt = job_record.next_attempt(rd)
        rd.logs.mkdir(exist_ok=True)  # a copied or pruned run dir may lack it
        if not wait:
            with open(rd.attempt_log(attempt), "ab") as log:
                proc, job_id = _start_node(rd, recipe, lock, attached=False, stdout=log, env={})
            if echo:
                echo(f"started {job_id}; run dir {rd.path}\nfollow it with: tail -f {rd.attempt_log(attempt)}")
            return SubmitResult(rd.path, LocalExecutor.cluster, False, job_id=job_id, state=State.RUNNING.value)
        if echo:
            echo(f"run dir {rd.path}")
        with _forwarding_signals(rd, recipe) as forward:
            # The job's output goes to our stderr: stdout stays clean for `--json`.
            tee = {"VLMRUN_TEE_LOG": str(rd.attempt_log(attempt))}
            proc, job_id = _start_node(rd, recipe, lock, attached=True, stdout=sys.stderr.fileno(), env=tee)
            lock.release()  # the node holds the run now; our copy would keep it locked after a kill
            code = forward.attach(proc).wait()
    return _result(rd, job_id, code, forward.kill_reason, echo)


def _start_node(rd: RunDirectory, recipe, lock: RunLock, *, attached: bool, stdout, env: dict[str, str]):
    """Start the node process holding `lock`, record it as the run's job, then let it begin its attempt."""
    recorded_r, recorded_w = os.pipe()
    cmd = node_command(str(rd.path))
    env = os.environ | env | {"PYTHONUNBUFFERED": "1", "VLMRUN_CLUSTER": "local"}
    env |= {FD_ENV: str(lock.fd), RECORDED_FD_ENV: str(recorded_r)}
    parent = os.getpid()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(lock.fd, recorded_r),
            preexec_fn=lambda: hold_stop_signals(parent if attached else None),
        )
    except BaseException:
        os.close(recorded_w)
        raise
    finally:
        os.close(recorded_r)
    try:
        job_id = local_job_id(proc.pid, start_time(proc.pid))  # the node names itself the same way
        lock.describe(Holder.of(proc.pid, job_id))
        job_record.add_job(rd, job_id, LocalExecutor.cluster, recipe.name)
        register_job(job_id, rd.path)  # so `vlmrun status|logs|requeue <job id>` find the run
    except BaseException:
        proc.kill()  # it waits for the pipe below: a job we could not record never begins
        proc.wait()
        raise
    finally:
        os.close(recorded_w)  # the node begins its attempt now
    return proc, job_id


class _Forwarder:
    """Passes the stop signals on to the node; a second SIGINT kills it hard, saying whether the stop
    checkpoint the first one asked for is already sealed (`kill_reason`: what job.json then records)."""

    def __init__(self, rd: RunDirectory, recipe) -> None:
        self.rd, self.recipe = rd, recipe
        self.proc: subprocess.Popen | None = None
        self.early: list[int] = []  # signals that came while the node was being started
        self.interrupts = 0
        self.kill_reason: str | None = None  # set once the node was killed hard

    def attach(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.proc = proc
        for signum in self.early:
            self.handle(signum, None)
        return proc

    def handle(self, signum, _frame) -> None:
        if self.proc is None:
            self.early.append(signum)
            return
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                said, self.kill_reason = _hard_kill_words(self.rd, self.recipe)
                _say(f"second interrupt: killing the job (pid {self.proc.pid}) hard, {said}")
                signum = signal.SIGKILL
            else:
                _say("interrupt: the job stops at a checkpoint after the step in flight (Ctrl-C again kills it)")
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)


def _hard_kill_words(rd: RunDirectory, recipe) -> tuple[str, str]:
    """(what the console says, what job.json records) of a kill by a second Ctrl-C: whether the run's
    last trained step is in a sealed checkpoint (the first Ctrl-C's stop got that far), or where a
    resume starts instead."""
    from vlmrun.checkpoint.store import run_checkpoints
    from vlmrun.run.metrics import last_metrics

    try:
        sealed = [step for step, _ in run_checkpoints(rd, recipe, assign=False).complete()]
        last = last_metrics(rd, recipe)["last_step"] or 0
    except (InputError, OSError):  # a damaged metrics file or an unreadable folder: say what is sure
        sealed, last = [], None
    newest = sealed[-1] if sealed else 0
    if sealed and last is not None and newest >= last:
        return (
            f"after its checkpoint of step {newest} (its last step) was sealed: `vlmrun resume` continues from it",
            f"killed by a second Ctrl-C (SIGKILL) after its checkpoint of step {newest} (its last step) was sealed",
        )
    start = f"step {newest}, its newest checkpoint" if sealed else "step 0 (no checkpoint)"
    return (
        f"without a checkpoint of its last step: `vlmrun resume` starts from {start}",
        f"killed by a second Ctrl-C (SIGKILL) before it checkpointed its last step; a resume starts from {start}",
    )


@contextlib.contextmanager
def _forwarding_signals(rd: RunDirectory, recipe):
    forwarder = _Forwarder(rd, recipe)
    previous = {s: signal.signal(s, forwarder.handle) for s in STOP_SIGNALS}
    try:
        yield forwarder
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _result(rd: RunDirectory, job_id: str, code: int, kill_reason: str | None, echo) -> SubmitResult:
    """The outcome job.json records; a node that died without recording one is recorded KILLED here
    (with `kill_reason` when a second Ctrl-C killed it)."""
    if code not in (EXIT_COMPLETED, EXIT_STOPPED, EXIT_BAD_INPUT):
        try:
            with contextlib.suppress(RunLocked), RunLock.acquire(rd.path):  # no attempt begins while we record
                job_record.mark_killed(rd, job_id, **({"reason": kill_reason} if kill_reason else {}))
        except OSError as e:  # a full disk, say: the run dir and what the job wrote stay as they are
            _say(f"could not record the end of {job_id} in {rd.job_file}: {failure_reason(e)}")
    job = job_record.read_job(rd)
    state = job.state if job is not None else State.FAILED
    if echo and state is State.STOPPED:
        echo(f"stopped at a checkpoint; continue with: vlmrun resume {rd.path} --wait")
    if kill_reason is not None:
        exit_code = EXIT_INTERRUPTED
    elif code in (EXIT_COMPLETED, EXIT_STOPPED, EXIT_BAD_INPUT):
        exit_code = code
    else:
        exit_code = EXIT_FAILED
    return SubmitResult(rd.path, LocalExecutor.cluster, False, job_id=job_id, state=state.value, exit_code=exit_code)


def _say(message: str) -> None:
    print(f"vlmrun: {message}", file=sys.stderr, flush=True)
