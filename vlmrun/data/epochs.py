"""Exact epochs: every usable sample of the split exactly once per epoch, and epochs that end at a step.

1. Energon deals the split out to its global loader workers (`parallel.dp` shards x `data.num_workers`,
   at least one per shard), at most one sample apart. Each worker's epoch is its share, shuffled by
   `data.shuffle_buffer` within the epoch (the buffer drains at the epoch's end instead of mixing
   in the next epoch's samples: vlmrun.data.epoch_stages).
2. A step takes `train.global_batch_size / parallel.dp` samples from each shard, as micro-batches of
   `train.micro_batch_size`; a shard takes transfer groups from its workers in turn. So that every
   epoch ends at a step boundary on every shard, each worker's epoch is made the same whole number
   of micro-batches (`EpochLayout.worker_micro_batches`): its own samples, then filler samples to
   that count. A filler repeats the sample before it with nothing to learn (no labelled token; a
   GRPO prompt's responses count for nothing) and an id `filler_id` marks, so no step, loss, count
   or metric takes it for a sample. Where the split divides evenly (the shipped recipes' 2048
   samples) there are none. A sample `data.on_bad_sample: drop` skips leaves one more filler.
3. The layout depends on the split's size, dp, the loader workers, the micro-batch size and the
   micro-batches per step; the loader shard's fingerprint holds the count it fills to.
4. This is loader format 2 (vlmrun.data.fingerprint). A run begun before it, in format 1 (Energon's own
   pipeline, whose buffer mixes an epoch's tail into the next one's head), keeps that format when it
   resumes, so it goes on bit for bit; `vlmrun resume --restart-data-order` moves it to this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlmrun.errors import InputError

#: A filler's id is its source sample's key and this mark: a key's last part never holds a dot
#: (Energon splits a tar member's name at its first dot), so no real sample's id has it.
FILLER_MARK = ".filler-"


def filler_id(key: str, n: int) -> str:
    """The id of the `n`-th filler (from 1) of a worker's epoch, a repeat of sample `key`."""
    return f"{key}{FILLER_MARK}{n}"


def is_filler(sample_id: str) -> bool:
    """Whether `sample_id` (a sample's, or an id made from it: a GRPO prompt's `~k`, a response's `#g`)
    names a filler (module doc)."""
    return FILLER_MARK in sample_id.rsplit("/", 1)[-1]


def real_ids(sample_ids) -> list[str]:
    """`sample_ids` without the fillers, in order."""
    return [i for i in sample_ids if not is_filler(i)]


@dataclass(frozen=True, kw_only=True)
class EpochLayout:
    """How one epoch of a split lays out over the loader workers and the steps (module doc)."""

    split_samples: int
    shards: int  # parallel.dp
    workers_per_shard: int  # max(1, data.num_workers)
    micro_batch_size: int
    micro_batches_per_step: int  # per replica

    @property
    def loader_workers(self) -> int:
        return self.shards * self.workers_per_shard

    @property
    def worker_micro_batches(self) -> int:
        """Micro-batches of each worker's epoch: enough for the largest share, and a whole number of
        steps for the shard's workers together."""
        largest = math.ceil(self.split_samples / self.loader_workers)
        needed = math.ceil(largest / self.micro_batch_size)
        unit = self.micro_batches_per_step // math.gcd(self.workers_per_shard, self.micro_batches_per_step)
        return math.ceil(needed / unit) * unit

    @property
    def worker_samples(self) -> int:
        """Samples of each worker's epoch, fillers included."""
        return self.worker_micro_batches * self.micro_batch_size

    @property
    def steps(self) -> int:
        return self.workers_per_shard * self.worker_micro_batches // self.micro_batches_per_step

    @property
    def fillers(self) -> int:
        """Filler samples per epoch, all shards (more where samples are dropped)."""
        return self.loader_workers * self.worker_samples - self.split_samples


def epoch_layout(recipe, split_samples: int, *, shards: int | None = None) -> EpochLayout:
    """The `EpochLayout` of `recipe` over its training split of `split_samples` samples, read by
    `shards` loader shards (default: parallel.dp, as a run has).

    Raises InputError when the split has fewer samples than loader workers (one would have none).
    """
    t, d = recipe.train, recipe.data
    dp = recipe.parallel.dp if shards is None else shards
    workers = max(1, d.num_workers)
    if split_samples < dp * workers:
        raise InputError(
            "data.split",
            d.split,
            message=f"data.split: {d.split!r} has {split_samples} sample(s), fewer than the loader workers that "
            f"share it (parallel.dp={dp} x data.num_workers={d.num_workers}, at least 1 per shard): lower "
            "data.num_workers or use a larger split",
        )
    return EpochLayout(
        split_samples=split_samples,
        shards=dp,
        workers_per_shard=workers,
        micro_batch_size=t.micro_batch_size,
        micro_batches_per_step=t.global_batch_size // (recipe.parallel.dp * t.micro_batch_size),
    )
