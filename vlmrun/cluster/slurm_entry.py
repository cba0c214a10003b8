"""What every node of a SLURM job runs: the node entrypoint in-process, then node 0's requeue decision.

1. submitit pickles `NodeEntrypoint(run_dir)`; on every node `python -m submitit.core._submit` loads
   it, installs submitit's USR2 handler (checkpoint + `scontrol requeue`) and calls it.
2. `__call__` prints the attempt marker (run/logs.py: how `vlmrun logs --attempt N` finds
   an attempt in submitit's appended log), then runs the node entrypoint (`python -m
   vlmrun.cluster.node`) as a child process in the task's process group, started with the stop signals
   blocked (spawn.py says why it cannot run in submitit's process). SLURM signals every process of
   the step: the node's stop flag takes USR2/TERM and the driver checkpoints at the next step
   boundary and returns STOPPED (exit 3); this process ignores them from then on (submitit's USR2
   handler would requeue at once) and waits. It dies with this process (PR_SET_PDEATHSIG).
   (A USR2 that arrives before that, while Python starts, meets submitit's own handler, which
   checkpoints through `checkpoint()` and requeues at once: nothing is lost since no step ran.)
3. Only then node 0 asks the requeue policy (requeue.py). A requeue goes through submitit's own path
   (submitit_api.py `requeue_this_job`): our `checkpoint()` re-pickles the submission with the
   time-limit requeues job.json says are left, `scontrol requeue <job id>` follows, and the process
   exits like submitit's handler (no result pickle: the job is not over). SLURM restarts the job with
   the same id and SLURM_RESTART_COUNT + 1, and submitit's folder layout stays as submitit expects.
4. A failed run raises (submitit records the traceback, SLURM ends the job FAILED); a stop that is
   not requeued returns 3 and job.json says why (BUDGET_EXHAUSTED, STOPPED, CANCELLED).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable

from vlmrun.cluster import requeue
from vlmrun.cluster.slurm_env import SlurmAllocation
from vlmrun.errors import EXIT_BAD_INPUT, CheckFailed
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import next_attempt, now, require_job
from vlmrun.run.logs import ATTEMPT_MARKER
from vlmrun.run.requests import CANCEL_REQUEST, REQUEUE_REQUEST, take_request
from vlmrun.run.state import EXIT_COMPLETED, EXIT_STOPPED, State

log = logging.getLogger(__name__)


class NodeFailed(CheckFailed):
    """The node entrypoint of a SLURM task ended with a failure."""


class NodeEntrypoint:
    """The function submitit runs on every node: `vlmrun.cluster.node.main(["--run-dir", run_dir])`.

    `main` replaces the node entrypoint (tests run trivial payloads); it must be picklable and take
    and return what `vlmrun.cluster.node.main` does (argv list -> exit code 0/1/2/3).
    """

    def __init__(self, run_dir: str, main: Callable[[list[str]], int] | None = None):
        self.run_dir = str(run_dir)
        self.main = main

    def __call__(self) -> int:
        alloc = SlurmAllocation.from_env()
        if alloc is None:
            raise NodeFailed("NodeEntrypoint runs inside a SLURM task (no SLURM_JOB_ID / SLURM_NODEID)")
        started = time.monotonic()
        rd = RunDirectory(self.run_dir)
        print(attempt_marker(alloc), flush=True)
        os.environ["VLMRUN_CLUSTER"] = "slurm"
        if alloc.node_rank == 0:
            os.environ["VLMRUN_TEE_LOG"] = str(rd.attempt_log(next_attempt(rd)))
        code = (self.main or _node_main)(["--run-dir", self.run_dir])
        if alloc.node_rank == 0 and code == EXIT_STOPPED:
            self._after_stop(rd, alloc, time.monotonic() - started)
        elif alloc.node_rank == 0 and code != EXIT_BAD_INPUT:
            # a request that came too late for this attempt must not steer a later one (a job refused
            # because another attempt holds the run dir leaves that attempt's requests be)
            for name in (REQUEUE_REQUEST, CANCEL_REQUEST):
                take_request(rd, name, alloc.job_id, alloc.restart_count)
        if code not in (EXIT_COMPLETED, EXIT_STOPPED):
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            raise NodeFailed(
                f"node {alloc.nodename} (rank {alloc.node_rank}): the node entrypoint {how}; "
                f"see {rd.job_file} and `vlmrun logs {alloc.job_id}`"
            )
        return code

    def checkpoint(self, *args, **kwargs):
        """submitit's requeue protocol: the submission to run again (the same entrypoint; state is on disk)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(NodeEntrypoint(self.run_dir, self.main))

    def _after_stop(self, rd: RunDirectory, alloc: SlurmAllocation, elapsed_s: float) -> None:
        recipe = rd.load_recipe()
        c = recipe.cluster
        requested = take_request(rd, REQUEUE_REQUEST, alloc.job_id, alloc.restart_count)
        cancelled = take_request(rd, CANCEL_REQUEST, alloc.job_id, alloc.restart_count)
        cause = requeue.classify_stop(elapsed_s, c.time_limit, c.signal_delay_s, requested=requested)
        decision = requeue.decide(
            require_job(rd), job_id=alloc.job_id, cause=cause, budget=recipe.checkpoint.requeue, cancelled=cancelled
        )
        requeue.record(rd, decision)
        log.info("job %s after %.0fs: %s (%s)", alloc.job_id, elapsed_s, decision.state, decision.reason)
        if not decision.requeue:
            return
        from vlmrun.cluster.submitit_api import requeue_this_job

        try:
            requeue_this_job(requeue.timeouts_left(require_job(rd).attempts, alloc.job_id, recipe.checkpoint.requeue))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, CheckFailed) as e:
            requeue.record(rd, requeue.RequeueDecision(False, State.STOPPED, cause, f"requeue failed: {e}"))
            log.error("requeue of job %s failed: %s; continue with `vlmrun resume %s`", alloc.job_id, e, rd.path)


def attempt_marker(alloc: SlurmAllocation) -> str:
    return (
        f"{ATTEMPT_MARKER} job={alloc.job_id} restart={alloc.restart_count} node={alloc.nodename} "
        f"rank={alloc.node_rank}/{alloc.num_nodes} time={now()} <=="
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _node_main(argv: list[str]) -> int:
    """The node entrypoint in a child process (spawn.py); its exit code, or -N when signal N killed it."""
    from vlmrun.algorithms.common.stop import ignore_stop_signals
    from vlmrun.cluster.spawn import hold_stop_signals, node_command

    ignore_stop_signals()  # from now on a stop signal is the node's business, not submitit's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nor ours: a KeyboardInterrupt here would kill the node unsaved
    parent = os.getpid()
    proc = subprocess.Popen(
        node_command(argv[argv.index("--run-dir") + 1]), preexec_fn=lambda: hold_stop_signals(parent)
    )
    return proc.wait()
