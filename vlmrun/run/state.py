"""The states of a run and of each of its attempts, as job.json, `vlmrun status` and exit codes use them.

PENDING (submitted, not started), RUNNING, COMPLETED (trained every step), STOPPED (checkpointed at a
step boundary on request; `vlmrun resume` continues it), REQUEUED (stopped and handed back to SLURM under
the same job id), BUDGET_EXHAUSTED (stopped; the recipe's requeue budget is spent; resumable), CANCELLED,
FAILED, KILLED (an attempt that ended without recording an outcome: SIGKILL, node loss). A run stays in an
ended state until someone resumes it.

Transitions (run/job.py writes them): submit adds the job id, PENDING; node 0 begins an attempt (RUNNING;
an earlier attempt still RUNNING becomes KILLED) and ends it with the controller's outcome, or FAILED. On
SLURM node 0 then decides about the requeue (cluster/requeue.py): only a stop by SIGUSR2 or `vlmrun
requeue` requeues, its cause (timeout or preemption) told by elapsed time and counted against
`checkpoint.requeue`. An attempt whose node died without recording its end becomes KILLED as soon as
someone finds it so (its reaper, the `--wait` launcher, `vlmrun cancel`, the next attempt).

Exit codes of the node and of `submit --wait` / `resume --wait`: 0 completed, 1 failed, 2 bad input, 3
stopped at a checkpoint (130: killed by a second Ctrl-C)."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """A run's or an attempt's state; the value is what job.json and `--json` outputs spell."""

    PENDING = "PENDING"  # submitted, not started
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # trained every step
    STOPPED = "STOPPED"  # checkpointed at a step boundary on request; `vlmrun resume` continues
    REQUEUED = "REQUEUED"  # stopped and handed back to SLURM, same job id
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"  # stopped; the recipe's requeue budget is spent (resumable)
    CANCELLED = "CANCELLED"  # `vlmrun cancel`
    FAILED = "FAILED"
    KILLED = "KILLED"  # an attempt that ended without recording an outcome (SIGKILL, node loss)

    @property
    def ended(self) -> bool:
        """True for the states a run stays in until someone resumes it."""
        return self in ENDED


ENDED = frozenset({State.COMPLETED, State.STOPPED, State.FAILED, State.CANCELLED, State.BUDGET_EXHAUSTED, State.KILLED})

# Exit codes of the node entrypoint (and of `submit --wait` / `resume --wait`).
EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_STOPPED = 3  # checkpointed at a step boundary; `vlmrun resume` continues it
