"""The `limit` rows of bench-loader: cook + encode + collate with no loader, samples in memory.

The split's tar files are read once into memory (timed as the `read` stage). With 0 workers the
work runs in a tight loop in the caller, each stage timed (decode = cooking and the image decode,
processor = chat template + tokenizer + image processor, collate): the compute-only floor. With k
workers, k forked processes do the same work on disjoint strides of the samples and hand the
micro-batches to the caller the way the Energon shard receives them (torch DataLoader, groups
collated into reused shared-memory blocks, `vlmrun.data.transport`): the ceiling any loader with k
worker processes can reach here, since every such loader must get its batches to the consumer.
"""

from __future__ import annotations

import logging
import tarfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from vlmrun.data.cookers import MalformedSample, decode_media
from vlmrun.data.transport import SlotPool, collate_packed, transfer_group

logger = logging.getLogger(__name__)


class LimitRunner:
    def __init__(self, recipe, *, processor_dir: str, num_workers: int):
        from vlmrun.config.families import family_spec
        from vlmrun.data.chat_encoding import ConversationEncoder
        from vlmrun.data.cookers import COOK_FUNCTIONS
        from vlmrun.data.loader import load_processor
        from vlmrun.data.splits import split_shards

        d = recipe.data
        t0 = time.perf_counter()
        self.samples = read_samples([Path(d.path) / name for name, _ in split_shards(d.path, d.split)])
        self._read_ms = (time.perf_counter() - t0) * 1000 / max(1, len(self.samples))
        self.encoder = ConversationEncoder(
            load_processor(processor_dir, recipe.family), family_spec(recipe.family), d.max_seq_len
        )
        self.cook = COOK_FUNCTIONS[d.cookers[0]]
        self.micro_batch_size = recipe.train.micro_batch_size
        self.transfer_samples = d.transfer_samples
        self.num_workers = num_workers
        self._stages = {"decode": 0.0, "processor": 0.0, "collate": 0.0}
        self._timed_samples = 0
        self._index = 0
        self._iterator = None
        self._pending: list = []
        self._loader = None
        self._pool = SlotPool(num_workers=num_workers)
        if num_workers:
            self._loader = DataLoader(
                _InMemoryGroups(self),
                batch_size=None,
                num_workers=num_workers,
                prefetch_factor=2,
                persistent_workers=True,
                multiprocessing_context="fork",
            )

    def next_batch(self):
        """The next micro-batch (timed by stage when there are no workers)."""
        if self._loader is None:
            return self._encode_timed()
        if self._iterator is None:
            self._iterator = iter(self._loader)  # forks the workers
        if not self._pending:
            self._pending = self._pool.unpack(next(self._iterator))
        return self._pending.pop(0)

    def _encode_timed(self):
        encoded, start = [], self._index
        while len(encoded) < self.micro_batch_size:
            raw = self.samples[self._index % len(self.samples)]
            self._index += 1
            t0 = time.perf_counter()
            try:
                conv = decode_media(self.cook(raw))
                t1 = time.perf_counter()
                encoded.append(self.encoder.encode(conv))
            except MalformedSample as e:  # the loaders skip it: so does the limit
                _skipped(e, len(encoded), self._index - start, len(self.samples))
                continue
            self._stages["decode"] += t1 - t0
            self._stages["processor"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        batch = self.encoder.collate(encoded)
        self._stages["collate"] += time.perf_counter() - t2
        self._timed_samples += len(encoded)
        return batch

    def stage_ms(self) -> dict[str, float] | None:
        """Mean milliseconds per sample of each stage; None for the multi-process rows."""
        if self._loader is not None:
            return None
        n = max(1, self._timed_samples)
        return {"read": round(self._read_ms, 4), **{k: round(v * 1000 / n, 4) for k, v in self._stages.items()}}

    def pids(self) -> list[int]:
        """Process ids of the worker processes (empty when the work runs in the caller's process)."""
        workers = getattr(self._iterator, "_workers", None) or []
        return [w.pid for w in workers]

    def close(self) -> None:
        if self._iterator is not None and hasattr(self._iterator, "_shutdown_workers"):
            self._iterator._shutdown_workers()
        self._iterator = self._loader = None


class _InMemoryGroups(IterableDataset):
    """Endless groups of micro-batches, each worker on its own stride of the in-memory samples."""

    def __init__(self, runner: LimitRunner):
        self.samples, self.encoder, self.cook = runner.samples, runner.encoder, runner.cook
        self.micro_batch_size = runner.micro_batch_size
        self.transfer_samples = runner.transfer_samples
        self.pool = runner._pool

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        index, step = info.id, info.num_workers
        size, group = self.micro_batch_size, transfer_group(self.micro_batch_size, self.transfer_samples)
        while True:
            groups = []
            for _ in range(group):
                encoded, tried = [], 0
                while len(encoded) < size:
                    raw = self.samples[index % len(self.samples)]
                    index, tried = index + step, tried + 1
                    try:
                        encoded.append(self.encoder.encode(self.cook(raw)))
                    except MalformedSample as e:
                        _skipped(e, len(encoded), tried, len(self.samples))
                groups.append(encoded)
            yield collate_packed(self.encoder, groups, self.pool)


def _skipped(error: Exception, encoded: int, tried: int, total: int) -> None:
    """Log a skipped sample; fail once a whole pass over the samples left a micro-batch unfilled."""
    if tried > total and encoded == 0:
        raise ValueError(f"limit: none of the {total} samples can be encoded (last: {error})")
    logger.warning("limit: skipped corrupt sample %s", error)


def read_samples(paths: list[Path]) -> list[dict]:
    """Every sample of the tar files as Energon hands it to a cooker (raw bytes per extension)."""
    samples: dict[str, dict] = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                sample = samples.setdefault(key, {"__key__": key, "__restore_key__": ()})
                sample[ext] = tar.extractfile(member).read()
    return list(samples.values())
