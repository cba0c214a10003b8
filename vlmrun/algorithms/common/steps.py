"""Step accounting: how many steps a run takes and how a step is cut into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """How many optimizer steps a run takes and how each step is cut into micro-batches.

    `max_steps = min(train.max_steps, epochs x steps_per_epoch)`; the LR schedule uses the same number.
    """

    max_steps: int
    steps_per_epoch: int
    dp: int
    global_batch_size: int
    micro_batch_size: int

    @property
    def samples_per_replica(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def micro_batches_per_replica(self) -> int:
        return self.samples_per_replica // self.micro_batch_size

    def epoch_of(self, step: int) -> int:
        return (step - 1) // self.steps_per_epoch


def plan_steps(recipe, train_samples: int) -> StepPlan:
    """`train_samples` is the size of the training split (all shards together)."""
    t = recipe.train
    per_epoch = recipe.data.virtual_epoch_length or max(1, train_samples // t.global_batch_size)
    return StepPlan(
        max_steps=min(t.max_steps, t.epochs * per_epoch),
        steps_per_epoch=per_epoch,
        dp=recipe.parallel.dp,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
    )
