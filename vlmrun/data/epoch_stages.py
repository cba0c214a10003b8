"""The Energon training pipeline of exact epochs (vlmrun.data.epochs), one loader worker's view:

    its share of the split, one epoch per iteration
      -> EpochShuffleBuffer   shuffled within the epoch; drains at its end
      -> encode               the task encoder's encode_sample (a sample that does not fit is skipped here)
      -> EpochFill            the epoch made exactly `samples` long with fillers
      -> batch                transfer groups of micro-batches; the epoch's last group may hold fewer
      -> repeat               epoch after epoch, for ever
      (-> epochize            data.virtual_epoch_length, as Energon's own pipeline)

Energon's own `get_train_dataset` repeats the share before its shuffle buffer, so the buffer mixes
each epoch's tail with the next epoch's head. Up to the epoch's last `data.shuffle_buffer` samples the
two orders are the same sample for sample (the same random draws on the same buffer).

Every stage saves where it is, so a worker restored anywhere (mid-epoch, while the buffer drains,
while fillers are made) continues exactly as an uninterrupted one, and every sample a saved group
holds is restored from its key (a filler from its source's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.energon import EpochizeDataset, RepeatDataset, ShuffleBufferDataset
from megatron.energon.flavors.base_dataset import add_sample_restore_key, set_sample_restore_key
from megatron.energon.wrappers.base import BaseWrapperDataset, get_sample_restore_key


class EpochShuffleBuffer(ShuffleBufferDataset):
    """Energon's shuffle buffer over one epoch of a finite dataset, with whether it drains in its
    state: restored while draining, it must not start the next epoch to refill."""

    _savable_fields = (*ShuffleBufferDataset._savable_fields, "_draining")

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self._draining = False

    def __iter__(self):
        buffer = self._active_buffer
        buffer.worker_start()
        if not self._draining:
            fill = iter(buffer.append_iter())
            while True:
                if buffer.len_worker() >= self.size:
                    yield buffer.pop(self._worker_rng.randbelow(buffer.len_worker()))
                    continue
                try:
                    next(fill)
                except StopIteration:
                    break
            self._draining = True
        while buffer.len_worker() > 0:
            yield buffer.pop(self._worker_rng.randbelow(buffer.len_worker()))
        self._draining = False


class EpochFill(BaseWrapperDataset):
    """Each iteration: the inner dataset's samples (one epoch), then fillers (`make_filler(source, n)`,
    a repeat of the last sample with the n-th filler's id) until `samples` came out."""

    _savable_fields = ("_yielded", "_fillers", "_filling", "_source_key")

    def __init__(self, dataset, *, samples: int, make_filler: Callable[[Any, int], Any], worker_config):
        super().__init__(dataset, worker_config=worker_config)
        self.samples, self.make_filler = samples, make_filler
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._yielded, self._fillers, self._filling = 0, 0, False
        self._source_key: tuple | None = None  # the inner key of the sample fillers repeat
        self._source = None

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.samples

    def __iter__(self):
        if not self._filling:
            for sample in self.dataset:
                self._yielded += 1
                self._source, self._source_key = sample, get_sample_restore_key(sample)
                yield add_sample_restore_key(sample, 0, src=self)
            self._filling = True
        while self._yielded < self.samples:
            self._yielded += 1
            self._fillers += 1
            yield self._filler(self._fillers)
        self._yielded, self._fillers, self._filling = 0, 0, False

    def _filler(self, n: int):
        if self._source_key is None:
            raise RuntimeError(
                f"a loader worker has no usable sample to fill its epoch with: every sample of its share "
                f"was skipped (worker {self.worker_config.rank_worker_id()} of shard {self.worker_config.rank})"
            )
        if self._source is None:  # restored while filling: the source comes back from its key
            self._source = self.dataset.restore_sample(self._source_key)
        return set_sample_restore_key(self.make_filler(self._source, n), n, *self._source_key, src=self)

    def restore_sample(self, restore_key: tuple):
        kind, n, *inner = restore_key
        assert kind == type(self).__name__
        sample = self.dataset.restore_sample(tuple(inner))
        if n == 0:
            return add_sample_restore_key(sample, 0, src=self)
        return set_sample_restore_key(self.make_filler(sample, n), n, *inner, src=self)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "samples": self.samples,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self):
        return f"EpochFill(samples={self.samples}, dataset={self.dataset})"


def build_exact_epochs(
    encoder,
    *,
    datasets: list,
    worker_config,
    batch_size: int,
    shuffle_buffer_size: int | None,
    virtual_epoch_length: int,
    epoch_samples: int,
):
    """The pipeline of the module doc for `encoder` (a task encoder with `filler(sample, n)`) over one
    prepared dataset; `epoch_samples`: each worker's epoch, fillers included (EpochLayout)."""
    if len(datasets) != 1:
        raise ValueError(f"exact epochs read one prepared dataset, not a blend of {len(datasets)}")
    dataset = encoder._load_dataset(datasets[0], 0, worker_config=worker_config)
    if shuffle_buffer_size is not None and shuffle_buffer_size > 1:
        dataset = EpochShuffleBuffer(dataset, size=shuffle_buffer_size, worker_config=worker_config)
    dataset = encoder.build_encode_sample(dataset, worker_config=worker_config)
    dataset = EpochFill(dataset, samples=epoch_samples, make_filler=encoder.filler, worker_config=worker_config)
    dataset = encoder.build_batch(
        dataset, batch_size=batch_size, batch_drop_last=False, packing_buffer_size=None, worker_config=worker_config
    )
    dataset = RepeatDataset(dataset, worker_config=worker_config)
    if virtual_epoch_length > 0:
        dataset = EpochizeDataset(dataset, length=virtual_epoch_length, worker_config=worker_config)
    return dataset
