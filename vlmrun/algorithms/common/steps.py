"""Step accounting: how many steps a run takes and how a step is cut into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

from vlmrun.data.epochs import epoch_layout
from vlmrun.data.fingerprint import LOADER_FORMAT


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """How many optimizer steps a run takes and how each step is cut into micro-batches.

    `max_steps = min(train.max_steps, epochs x steps_per_epoch)`; the LR schedule uses the same number.
    An epoch trains every usable sample of the split once (vlmrun.data.epochs); `asked_steps` is
    train.max_steps, `epochs` train.epochs and `split_samples` the split's size, for `cap`.
    """

    max_steps: int
    steps_per_epoch: int
    dp: int
    global_batch_size: int
    micro_batch_size: int
    asked_steps: int = 0
    epochs: int = 1
    split_samples: int = 0

    @property
    def samples_per_replica(self) -> int:
        return self.global_batch_size // self.dp

    @property
    def micro_batches_per_replica(self) -> int:
        return self.samples_per_replica // self.micro_batch_size

    def epoch_of(self, step: int) -> int:
        return (step - 1) // self.steps_per_epoch

    @property
    def capped(self) -> bool:
        """train.epochs, not train.max_steps, ends the run."""
        return self.max_steps < self.asked_steps

    def cap(self) -> str:
        """'train.epochs: E caps train.max_steps=N', or '' where the epochs leave train.max_steps alone."""
        return f"train.epochs: {self.epochs} caps train.max_steps={self.asked_steps}" if self.capped else ""

    def cap_advice(self) -> str:
        """One line for submit: what caps the run, and the train.epochs that would train all of train.max_steps."""
        if not self.capped:
            return ""
        need = -(-self.asked_steps // self.steps_per_epoch)
        return (
            f"{self.cap()} to {self.max_steps} steps ({self.steps_per_epoch} per epoch over the "
            f"{self.split_samples} samples of the split); --set train.epochs={need} trains all {self.asked_steps}"
        )


def plan_steps(recipe, train_samples: int, *, loader_format: int = LOADER_FORMAT) -> StepPlan:
    """`train_samples` is the size of the training split (all shards together); `loader_format` the
    run's (vlmrun.data.fingerprint: a run resumed from an older format keeps that format's epochs).
    Raises InputError for a split with fewer samples than loader workers (vlmrun.data.epochs)."""
    t = recipe.train
    if loader_format >= 2:
        per_epoch = recipe.data.virtual_epoch_length or epoch_layout(recipe, train_samples).steps
    else:  # Energon's own epochs: the split's whole batches
        per_epoch = recipe.data.virtual_epoch_length or max(1, train_samples // t.global_batch_size)
    return StepPlan(
        max_steps=min(t.max_steps, t.epochs * per_epoch),
        steps_per_epoch=per_epoch,
        dp=recipe.parallel.dp,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        asked_steps=t.max_steps,
        epochs=t.epochs,
        split_samples=train_samples,
    )


def run_loader_format(found, *, restart: bool) -> int:
    """The loader format a run's attempt reads (vlmrun.data.fingerprint): that of the checkpoint `found`
    it resumes from (a run keeps the stream it began with, so it continues bit for bit across a vlmrun
    upgrade), the current one for a fresh run or one whose data order starts over (`restart`)."""
    return found.manifest.loader_format if found is not None and not restart else LOADER_FORMAT
