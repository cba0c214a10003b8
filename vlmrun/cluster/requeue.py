"""Requeue policy: after the driver stopped at a checkpoint, does SLURM run the job again?

1. Only a stop caused by SIGUSR2 requeues (SLURM's time-limit signal, a preemption notice, or
   `vlmrun requeue`). A run that finished, failed, was stopped by SIGTERM or cancelled never requeues.
2. The cause is told apart by elapsed time, like submitit: an attempt that ran into the last
   `signal_delay_s + TICK_SLACK_S` seconds of its time limit hit the time limit (`timeout`); an
   earlier USR2 is a `preemption`; `vlmrun requeue` writes REQUEUE_REQUESTED first (`requested`).
3. Budgets per job id: `recipe.checkpoint.requeue.timeouts` and `.preemptions`, counted from the
   attempts of that job id in job.json (`requeue_cause`). A requested requeue uses no budget. An
   exhausted budget ends the job with state BUDGET_EXHAUSTED (resumable with `vlmrun resume`).
4. `signal_delay_warnings` says at submit time when `signal_delay_s` looks too short for one step
   plus a checkpoint; the assumptions are in the message (see `_STEP_S`, `_BYTES_PER_PARAM`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vlmrun.run.directory import RunDirectory

TICK_SLACK_S = 60                 # slurmctld checks time-limit signals every 30 s, plus job launch time
CAUSES = ("timeout", "preemption", "requested")


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    state: str       # the job's state after this attempt: REQUEUED, BUDGET_EXHAUSTED, STOPPED, CANCELLED, ...
    cause: str | None
    reason: str


def classify_stop(elapsed_s: float, time_limit_min: int, signal_delay_s: int, *, requested: bool) -> str:
    """'requested', 'timeout' (within the last signal_delay_s + TICK_SLACK_S s of the limit) or 'preemption'."""
    if requested:
        return "requested"
    return "timeout" if elapsed_s >= time_limit_min * 60 - signal_delay_s - TICK_SLACK_S else "preemption"


def stop_signal(attempt: dict) -> str | None:
    """The signal that stopped an attempt: its `stop_signal`, else the `(SIG...)` in its reason."""
    if attempt.get("stop_signal"):
        return attempt["stop_signal"]
    m = re.search(r"\((SIG[A-Z0-9]+)\)", attempt.get("reason") or "")
    return m.group(1) if m else None


def used_budget(job: dict, job_id: str) -> dict[str, int]:
    """Requeues so far of `job_id`, per cause."""
    used = dict.fromkeys(CAUSES, 0)
    for a in job.get("attempts", []):
        if a.get("job_id") == job_id and a.get("requeue_cause") in used:
            used[a["requeue_cause"]] += 1
    return used


def decide(job: dict, *, job_id: str, cause: str, budget, cancelled: bool = False) -> RequeueDecision:
    """What to do after the last attempt of `job` ended; `budget` is recipe.checkpoint.requeue."""
    last = job["attempts"][-1] if job.get("attempts") else {}
    state = last.get("state", "FAILED")
    if state != "STOPPED":
        return RequeueDecision(False, state, None, last.get("reason", ""))
    if cancelled:
        return RequeueDecision(False, "CANCELLED", None, "cancelled by `vlmrun cancel`; checkpointed, not requeued")
    sig = stop_signal(last)
    if sig != "SIGUSR2" and cause != "requested":
        return RequeueDecision(False, "STOPPED", None, f"stopped by {sig or 'a request'}; only SIGUSR2 requeues")
    if cause == "requested":
        return RequeueDecision(True, "REQUEUED", cause, "requeue requested with `vlmrun requeue`")
    allowed = budget.timeouts if cause == "timeout" else budget.preemptions
    used = used_budget(job, job_id)[cause]
    if used >= allowed:
        field = "timeouts" if cause == "timeout" else "preemptions"
        return RequeueDecision(False, "BUDGET_EXHAUSTED", cause,
                               f"{cause} #{used + 1} of job {job_id} exceeds checkpoint.requeue.{field}={allowed}; "
                               "continue with `vlmrun resume`")
    return RequeueDecision(True, "REQUEUED", cause, f"{cause} {used + 1}/{allowed}: requeued")


def record(rd: RunDirectory, decision: RequeueDecision) -> None:
    """Write the decision into job.json: the last attempt's `requeue_cause`, the job's state and reason."""
    job = rd.read_job()
    if job.get("attempts"):
        last = job["attempts"][-1]
        if decision.requeue:
            last["requeue_cause"] = decision.cause
        else:
            last.pop("requeue_cause", None)
        last["requeue_decision"] = decision.reason
    job["state"] = decision.state
    job["reason"] = decision.reason
    rd.write_job(job)


