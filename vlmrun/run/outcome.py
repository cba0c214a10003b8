"""The outcome of one attempt, as the training driver returns it and the node records it in job.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vlmrun.run.state import State


@dataclass
class RunOutcome:
    """How an attempt ended (`state` is COMPLETED or STOPPED here; failures are exceptions).

    `stop_signal` is the signal that stopped the run (SIGUSR2, SIGTERM, SIGINT), None for a run that
    finished or was stopped by a request; the requeue decision reads it.
    """

    state: State
    last_step: int
    reason: str
    stop_signal: str | None = None
    max_steps: int | None = None
    resumed_from: int | None = None
    restarted_data_order: str | None = None  # resumed from another dp: from which layout, what was kept and lost
    first_step_s: float | None = None
    checkpoint_save_s: list[float] = field(default_factory=list)
    checkpoint_write_s: list[float] = field(default_factory=list)  # each one's start to its seal (behind the steps)
    skipped_checkpoints: list[str] = field(default_factory=list)
    final_val: dict[str, float] = field(default_factory=dict)
    worker_nodes: list[str] = field(default_factory=list)
    ray_alive_nodes: int | None = None
    policy_layout: str | None = None  # how the ranks held the model, e.g. "HSDP: 2 replicas x 2 shards (FSDP2)"
    policy_load: str | None = None  # how they got its weights, e.g. "whole on every rank (replicated)"

    def details(self) -> dict[str, Any]:
        """What job.json keeps beside the attempt's state, reason, last step and stop signal."""
        skip = {"state", "last_step", "reason", "stop_signal"}
        return {k: v for k, v in asdict(self).items() if k not in skip and v not in (None, [])}
