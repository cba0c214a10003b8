"""The data-plane seam: what every algorithm talks to when bulk tensors move between stages.

1. A partition (one per step, e.g. "grpo-step-12") is registered with a `PartitionSpec`: its fields
   (names from the field registry, fields.py), how many samples it will hold, and the stages that
   consume it with the fields each reads (stages are the algorithm's names). A name is registered
   once; `clear` forgets it.
2. `put` writes samples by id, one value per sample per field, with optional per-sample tags. The
   first write of an id creates the sample; later stages add columns under the same ids (all ids of
   one put are new, or all exist). A field is written once per sample: no overwrite.
3. `get` reads samples by id (any subset: a dp shard) and an explicit field list: never "all". It
   returns exactly the shapes and dtypes that were put (pixel values in the plane's `pixel_dtype`).
   A field the partition lacks, or one not yet written for some requested sample, raises.
4. `state_dict` holds every registered partition (at a step boundary there is none: it is empty).
5. Writes to one sample must not run concurrently (a sample's tags are replaced whole by some
   backends); sync GRPO writes each sample from one stage at a time.
6. `put_many` / `get_many` take a stage's requests at once (e.g. a step's prompt samples and its
   response samples, or every replica's partition): an adapter over the network overlaps their round
   trips. They mean what the same `put`s / `get`s one after the other mean, and one `put_many` writes a
   sample at most once.

Adapters: `local` (process-local; SFT v2) and `transfer_queue` (TransferQueue with its simple
in-memory storage or Mooncake). Algorithms import this module, never a backend package.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Per sample: a tensor, or for a media field the list of its segments (see wire/codec.py).
Value = Any
#: field name -> one value per sample, in the order of the sample ids.
Columns = Mapping[str, Sequence[Value]]


class DataPlaneError(RuntimeError):
    """A use of the plane that breaks its protocol (an unknown field, a second write, a read of a field
    nobody wrote, ...). Our bug, not the user's: it keeps its traceback."""


@dataclass(frozen=True, kw_only=True)
class PartitionSpec:
    """What a partition holds: `fields` (registry names), `num_samples` (its capacity) and `reads`, each
    consuming stage (the algorithm's name for it) with the fields it reads. Build it with `reading`.
    Refuses unknown fields, a field no consumer reads, a consumer that reads nothing, and a consumer
    reading a field the partition lacks."""

    fields: tuple[str, ...]
    num_samples: int
    reads: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        from vlmrun.plane.fields import FIELDS

        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "reads", {str(stage): tuple(f) for stage, f in self.reads.items()})
        unknown = [f for f in self.fields if f not in FIELDS]
        if unknown:
            raise DataPlaneError(f"unknown field(s) {unknown}; known: {', '.join(sorted(FIELDS))}")
        if len(set(self.fields)) != len(self.fields) or not self.fields:
            raise DataPlaneError(f"a partition names each field once and at least one: {self.fields}")
        if self.num_samples < 1:
            raise DataPlaneError(f"a partition holds at least one sample, not {self.num_samples}")
        idle = [stage for stage, fields in self.reads.items() if not fields]
        if idle:
            raise DataPlaneError(f"consumer(s) {idle} read no field")
        unread = [f for f in self.fields if not any(f in read for read in self.reads.values())]
        if unread:
            raise DataPlaneError(f"field(s) {unread} are read by none of the consumers {self.consumers}")
        missing = {stage: [f for f in read if f not in self.fields] for stage, read in self.reads.items()}
        if any(missing.values()):
            raise DataPlaneError(f"consumers read field(s) {missing}, which the partition lacks")

    @classmethod
    def reading(cls, reads: Mapping[str, Sequence[str]], num_samples: int) -> PartitionSpec:
        """A partition of every field some consumer of `reads` reads, each list in registry order."""
        from vlmrun.plane.fields import in_registry_order

        return cls(
            fields=in_registry_order(f for read in reads.values() for f in read),
            num_samples=num_samples,
            reads={str(stage): in_registry_order(read) for stage, read in reads.items()},
        )

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(self.reads)

    def stage_fields(self, stage: str) -> tuple[str, ...]:
        """The fields `stage` reads: the list it passes to `get`. KeyError for a stage that does not
        consume the partition."""
        return self.reads[str(stage)]

    def to_dict(self) -> dict[str, Any]:
        reads = {stage: list(fields) for stage, fields in self.reads.items()}
        return {"fields": list(self.fields), "num_samples": self.num_samples, "reads": reads}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartitionSpec:
        return cls(fields=tuple(d["fields"]), num_samples=int(d["num_samples"]), reads=dict(d["reads"]))


@dataclass
class SampleBatch:
    """Samples read from a partition: `columns[field][i]` is sample `sample_ids[i]`'s value; `tags[i]`
    its tags as the writers gave them."""

    sample_ids: list[str]
    columns: dict[str, list[Value]] = field(default_factory=dict)
    tags: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, name: str) -> list[Value]:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def stack(self, name: str):
        """A per-sample field as one tensor (samples along dim 0), e.g. rewards as shape (N,)."""
        import torch

        return torch.stack(self.columns[name])


@dataclass(frozen=True)
class Put:
    """One request of `put_many`: `put(partition, sample_ids, columns, tags)`."""

    partition: str
    sample_ids: Sequence[str]
    columns: Columns
    tags: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Get:
    """One request of `get_many`: `get(partition, sample_ids, fields)`."""

    partition: str
    sample_ids: Sequence[str]
    fields: Sequence[str]


class DataPlane(abc.ABC):
    @abc.abstractmethod
    def register(self, partition: str, spec: PartitionSpec) -> None:
        """Create `partition`; refuses a name that is registered (clear it first)."""

    @abc.abstractmethod
    def spec(self, partition: str) -> PartitionSpec:
        """The spec `partition` was registered with; `DataPlaneError` when there is none."""

    @abc.abstractmethod
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Columns,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Write `columns` for `sample_ids`: the first write of new ids, or new columns of existing ids.
        `tags` (one small JSON-like dict per sample) are merged into the samples' tags. Not atomic
        across backends: after an error, clear the partition."""

    @abc.abstractmethod
    def get(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> SampleBatch:
        """The values of `fields` (an explicit list of names) for `sample_ids`, in that order."""

    def put_many(self, requests: Sequence[Put]) -> None:
        """Every request of `requests` (module doc)."""
        for r in requests:
            self.put(r.partition, r.sample_ids, r.columns, r.tags)

    def get_many(self, requests: Sequence[Get]) -> list[SampleBatch]:
        """What each request of `requests` gets, in order (module doc)."""
        return [self.get(r.partition, r.sample_ids, r.fields) for r in requests]

    @abc.abstractmethod
    def list_sample_ids(self, partition: str) -> list[str]:
        """The ids written into `partition`, in the order of their first write."""

    @abc.abstractmethod
    def partitions(self) -> list[str]:
        """The registered partitions, sorted."""

    @abc.abstractmethod
    def clear(self, partition: str) -> None:
        """Forget `partition` and its samples (its readers are done); a no-op for an unknown name."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Every registered partition with its samples, for a checkpoint (empty at a step boundary)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (into a plane that does not hold those partitions)."""

    def close(self) -> None:  # noqa: B027 - most adapters hold nothing to release
        """Release this client's connections; the partitions stay with the backend."""
