"""Where a run's jobs run: the executor every launch command dispatches through.

1. Two executors: `LocalExecutor` (launch/local.py) runs the node entrypoint as a child process on
   this machine; `SlurmExecutor` (launch/slurm/executor.py) submits it with sbatch and asks squeue,
   scontrol and sacct about it. submit, resume, status, logs, cancel and requeue call the methods
   below and never ask which executor they hold.
2. Which one: the run's own (job.json's `cluster`) for every command on an existing run, `--cluster`
   for a new one (launch/targets.py `executor_of`, `resolve_cluster`). A run keeps its executor.
3. `cancel` ends the job through the executor, then records what job.json lacks (launch/control.py):
   the executor says what it had to do (`Ending.reason`), so a job that had to be killed is recorded
   as killed by `vlmrun cancel`, not as lost.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal


@dataclass(frozen=True)
class AttemptLog:
    """Where one attempt's log is and whether its job still writes it.

    `marker` is (job id, restart count) when the file holds other attempts too (SLURM appends every
    restart to one task log; run/logs.py slices it), None when the file is the attempt's own.
    """

    path: Path
    live: Callable[[], bool]
    marker: tuple[str, int] | None = None


@dataclass(frozen=True)
class Ending:
    """How `cancel` ended a job: its id, and the reason to record when it ended without recording one."""

    job_id: str | None
    reason: str | None = None


class Executor(ABC):
    """Starts a run's jobs and answers for them; one instance serves any number of runs."""

    cluster: ClassVar[Literal["local", "slurm"]]  # what job.json's `cluster` says for its runs
    runs_here: ClassVar[bool]  # the job runs on this machine (the preflight counts its GPUs)
    queues: ClassVar[bool]  # a job may wait in a queue before it begins an attempt

    @abstractmethod
    def dry_run(self, rd, recipe, *, echo=None):
        """The SubmitResult of a dry run: what would be written and submitted; creates nothing."""

    @abstractmethod
    def submit(self, rd, recipe, *, wait: bool, echo=None):
        """Start the first job of a new run in `rd` (created here); a SubmitResult."""

    @abstractmethod
    def resume(self, rd, recipe, *, wait: bool, lock, echo=None):
        """Start a new job that continues the ended run in `rd`; `lock` is the run lock the caller took."""

    @abstractmethod
    def refuse_while_live(self, rd, job, job_id: str | None, target: str) -> None:
        """Raise InputError (naming `target`) while a job of the run still runs or waits to run."""

    @abstractmethod
    def state(self, rd, job, job_id: str | None) -> dict:
        """`state` (the run's, combining the executor's view with job.json's) and the executor's own keys."""

    @abstractmethod
    def attempt_log(self, rd, job, index: int, job_id: str | None) -> AttemptLog:
        """Where attempt `index` of the run logs (the next one when it has none yet)."""

    @abstractmethod
    def cancel(self, rd, job, job_id: str | None, *, wait_s: float, kill_wait_s: float) -> Ending:
        """Ask the running or queued job to stop, kill it after `wait_s`, return once it has ended."""

    @abstractmethod
    def requeue(self, rd, job, job_id: str | None, target: str) -> dict:
        """Ask the running job to checkpoint at the next step and go on in a new attempt; what was sent."""


def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> bool:
    """Poll `done` until it is true (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
