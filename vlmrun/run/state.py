"""The states of a run and of each of its attempts, as job.json, `vlmrun status` and exit codes use them."""

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
