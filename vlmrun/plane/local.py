"""The process-local data plane: partitions in this process's memory (SFT v2's owner rank).

Zero-copy where the wire allows: a contiguous value is stored as a view of the caller's tensor (media
segments of one sample are concatenated once), and `get` returns views of what is stored. So a caller
must not change a tensor in place after putting it, nor a returned one before clearing the partition.
Not thread-safe: one owner writes and reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrun.plane.interface import DataPlaneError
from vlmrun.plane.rows import RESERVED_TAG, Lookup, Read, RowPlane, Rows, RowStore, Tagged, Write
from vlmrun.plane.wire.codec import join


@dataclass
class _Sample:
    tags: dict[str, Any]
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Partition:
    spec: dict[str, Any]
    samples: dict[str, _Sample] = field(default_factory=dict)


class LocalStore(RowStore):
    def __init__(self) -> None:
        self._parts: dict[str, _Partition] = {}

    def create_partition(self, partition: str, spec: dict[str, Any]) -> None:
        if partition in self._parts:
            raise DataPlaneError(f"partition {partition!r} is already registered (clear it first)")
        self._parts[partition] = _Partition(spec=dict(spec))

    def partition_specs(self, partitions: list[str]) -> list[dict[str, Any] | None]:
        return [dict(self._parts[p].spec) if p in self._parts else None for p in partitions]

    def partition_names(self) -> list[str]:
        return list(self._parts)

    def sample_ids(self, partition: str) -> list[str]:
        return list(self._parts[partition].samples)

    def sample_tags(self, requests: list[tuple[str, list[str]]]) -> list[Tagged]:
        return [Tagged(self._tags(partition, ids)) for partition, ids in requests]

    def lookup(self, requests: list[tuple[str, list[str]]]) -> list[Lookup]:
        out = []
        for partition, ids in requests:
            part = self._parts.get(partition)
            count, spec = (0, None) if part is None else (len(part.samples), dict(part.spec))
            out.append(Lookup(self._tags(partition, ids), count=count, spec=spec))
        return out

    def write(self, writes: list[Write]) -> None:
        for w in writes:
            samples = self._parts[w.partition].samples
            for i, sid in enumerate(w.ids):
                if w.create:
                    samples[sid] = _Sample(tags=w.tags[i])
                sample = samples[sid]
                sample.tags = w.tags[i]
                wire = w.tags[i][RESERVED_TAG]["fields"]
                sample.rows.update({name: join(column[i], wire[name]) for name, column in w.rows.items()})

    def read(self, reads: list[Read]) -> list[Rows]:
        out = []
        for r in reads:
            samples = self._parts[r.partition].samples
            out.append({name: [samples[sid].rows[name] for sid in r.ids] for name in r.fields})
        return out

    def drop(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def _tags(self, partition: str, ids: list[str]) -> list[dict[str, Any] | None]:
        part = self._parts.get(partition)
        samples = {} if part is None else part.samples
        return [samples[i].tags if i in samples else None for i in ids]


class LocalDataPlane(RowPlane):
    """The `local` adapter; pixel values are cast to `pixel_dtype` before they are stored (None: as given)."""

    def __init__(self, *, pixel_dtype: torch.dtype | None = None):
        super().__init__(LocalStore(), pixel_dtype=pixel_dtype)
