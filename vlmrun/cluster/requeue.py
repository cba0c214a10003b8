"""Requeue policy: after the driver stopped at a checkpoint, does SLURM run the job again?

1. Only a stop caused by SIGUSR2 requeues (SLURM's time-limit signal, a preemption notice, or
   `vlmrun requeue`). A run that finished, failed, was stopped by SIGTERM or cancelled never requeues.
   The signal is the attempt's `stop_signal` in job.json, which the node records (run/job.py).
2. The cause is told apart by elapsed time, like submitit: an attempt that ran into the last
   `signal_delay_s + TICK_SLACK_S` seconds of its time limit hit the time limit (`timeout`); an
   earlier USR2 is a `preemption`; `vlmrun requeue` writes REQUEUE_REQUESTED first (`requested`).
3. Budgets per job id: `recipe.checkpoint.requeue.timeouts` and `.preemptions`, counted from the
   attempts of that job id in job.json (`requeue_cause`). A requested requeue uses no budget. An
   exhausted budget ends the job with state BUDGET_EXHAUSTED (resumable with `vlmrun resume`).
   This is the one count: submitit's own countdown of time-limit requeues is set from
   `timeouts_left` at submit and at every requeue (cluster/submitit_api.py), never read back.
4. `signal_delay_warnings` says at submit time when `signal_delay_s` looks too short for one step
   plus a checkpoint; the assumptions are in the message (see `_STEP_S`, `_BYTES_PER_PARAM`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import Attempt, JobRecord, RequeueCause, require_job, write_job
from vlmrun.run.state import State

TICK_SLACK_S = 60  # slurmctld checks time-limit signals every 30 s, plus job launch time
CAUSES: tuple[RequeueCause, ...] = get_args(RequeueCause)


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    state: State  # the job's state after this attempt: REQUEUED, BUDGET_EXHAUSTED, STOPPED, CANCELLED, ...
    cause: RequeueCause | None
    reason: str


def classify_stop(elapsed_s: float, time_limit_min: int, signal_delay_s: int, *, requested: bool) -> RequeueCause:
    """'requested', 'timeout' (within the last signal_delay_s + TICK_SLACK_S s of the limit) or 'preemption'."""
    if requested:
        return "requested"
    return "timeout" if elapsed_s >= time_limit_min * 60 - signal_delay_s - TICK_SLACK_S else "preemption"


def used_budget(attempts: Sequence[Attempt], job_id: str | None) -> dict[str, int]:
    """Requeues so far of `job_id` among `attempts`, per cause (every cause present, 0 when unused)."""
    used = dict.fromkeys(CAUSES, 0)
    for a in attempts:
        if a.job_id == job_id and a.requeue_cause is not None:
            used[a.requeue_cause] += 1
    return used


def timeouts_left(attempts: Sequence[Attempt], job_id: str | None, budget) -> int:
    """Time-limit requeues `job_id` has left: `budget.timeouts` (recipe.checkpoint.requeue) less the
    ones its attempts recorded; a new job id has the whole budget."""
    return budget.timeouts - used_budget(attempts, job_id)["timeout"]


def decide(job: JobRecord, *, job_id: str, cause: RequeueCause, budget, cancelled: bool = False) -> RequeueDecision:
    """What to do after the last attempt of `job` ended; `budget` is recipe.checkpoint.requeue."""
    if not job.attempts:
        return RequeueDecision(False, State.FAILED, None, "no attempt was recorded")
    last = job.attempts[-1]
    if last.state is not State.STOPPED:
        return RequeueDecision(False, last.state, None, last.reason or "")
    if cancelled:
        return RequeueDecision(False, State.CANCELLED, None, "cancelled by `vlmrun cancel`; checkpointed, not requeued")
    if last.stop_signal != "SIGUSR2" and cause != "requested":
        return RequeueDecision(
            False, State.STOPPED, None, f"stopped by {last.stop_signal or 'a request'}; only SIGUSR2 requeues"
        )
    if cause == "requested":
        return RequeueDecision(True, State.REQUEUED, cause, "requeue requested with `vlmrun requeue`")
    allowed = budget.timeouts if cause == "timeout" else budget.preemptions
    used = used_budget(job.attempts, job_id)[cause]
    if used >= allowed:
        field = "timeouts" if cause == "timeout" else "preemptions"
        return RequeueDecision(
            False,
            State.BUDGET_EXHAUSTED,
            cause,
            f"{cause} #{used + 1} of job {job_id} exceeds checkpoint.requeue.{field}={allowed}; "
            "continue with `vlmrun resume`",
        )
    return RequeueDecision(True, State.REQUEUED, cause, f"{cause} {used + 1}/{allowed}: requeued")


def record(rd: RunDirectory, decision: RequeueDecision) -> None:
    """Write the decision into job.json: the last attempt's `requeue_cause` (only when requeued) and
    `requeue_decision`, the job's state and reason. Raises InputError when the run has no job.json."""
    job = require_job(rd)
    if job.attempts:
        last = job.attempts[-1]
        last.requeue_cause = decision.cause if decision.requeue else None
        last.requeue_decision = decision.reason
    job.state, job.reason = decision.state, decision.reason
    write_job(rd, job)
