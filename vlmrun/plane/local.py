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
from vlmrun.plane.rows import RESERVED_TAG, RowPieces, RowPlane, Rows, RowStore
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

    def partition_spec(self, partition: str) -> dict[str, Any] | None:
        part = self._parts.get(partition)
        return None if part is None else dict(part.spec)

    def partition_names(self) -> list[str]:
        return list(self._parts)

    def sample_ids(self, partition: str) -> list[str]:
        return list(self._parts[partition].samples)

    def sample_tags(self, partition: str, ids: list[str]) -> list[dict[str, Any] | None]:
        samples = self._parts[partition].samples
        return [samples[i].tags if i in samples else None for i in ids]

    def write(
        self, partition: str, ids: list[str], tags: list[dict[str, Any]], rows: RowPieces, *, create: bool
    ) -> None:
        samples = self._parts[partition].samples
        for i, sid in enumerate(ids):
            if create:
                samples[sid] = _Sample(tags=tags[i])
            sample = samples[sid]
            sample.tags = tags[i]
            wire = tags[i][RESERVED_TAG]["fields"]
            sample.rows.update({name: join(column[i], wire[name]) for name, column in rows.items()})

    def read(self, partition: str, ids: list[str], fields: list[str], tags: list[dict[str, Any]]) -> Rows:
        samples = self._parts[partition].samples
        return {name: [samples[sid].rows[name] for sid in ids] for name in fields}

    def drop(self, partition: str) -> None:
        self._parts.pop(partition, None)


class LocalDataPlane(RowPlane):
    """The `local` adapter; pixel values are cast to `pixel_dtype` before they are stored (None: as given)."""

    def __init__(self, *, pixel_dtype: torch.dtype | None = None):
        super().__init__(LocalStore(), pixel_dtype=pixel_dtype)
