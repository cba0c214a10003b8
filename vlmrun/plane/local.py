"""The process-local data plane: a step's batch is written once, committed, read, then cleared.

Partitions are named per step (e.g. "step-12/shard-0"). A partition accepts exactly one write; it is
readable only after `commit`; `abort` drops it. A checkpoint may be taken only when no partition is
open (written but not yet committed or aborted): `state_dict` refuses otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmrun.plane.interface import DataPlane, DataPlaneError


@dataclass
class _Partition:
    payload: Any = None
    sample_ids: list[str] = field(default_factory=list)
    written: bool = False
    committed: bool = False


class LocalDataPlane(DataPlane):
    """Not thread-safe: one owner (the replica's owner rank) writes and reads it."""

    def __init__(self) -> None:
        self._parts: dict[str, _Partition] = {}

    def put(self, partition: str, payload: Any, sample_ids: list[str]) -> None:
        part = self._parts.setdefault(partition, _Partition())
        if part.written:
            raise DataPlaneError(f"partition {partition} was already written (exactly one write per partition)")
        part.payload, part.sample_ids, part.written = payload, list(sample_ids), True

    def commit(self, partition: str) -> None:
        part = self._require(partition)
        if not part.written:
            raise DataPlaneError(f"partition {partition} has nothing to commit")
        part.committed = True

    def abort(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def get(self, partition: str) -> Any:
        part = self._require(partition)
        if not part.committed:
            raise DataPlaneError(f"partition {partition} is not committed")
        return part.payload

    def list_sample_ids(self, partition: str) -> list[str]:
        return list(self._require(partition).sample_ids)

    def clear(self, partition: str) -> None:
        self._parts.pop(partition, None)

    def partitions(self) -> list[str]:
        return sorted(self._parts)

    def in_flight(self) -> list[str]:
        return sorted(name for name, p in self._parts.items() if not p.committed)

    def state_dict(self) -> dict[str, Any]:
        """Committed partitions only; refuses while a write is in flight."""
        if self.in_flight():
            raise DataPlaneError(f"cannot checkpoint with uncommitted partitions in flight: {self.in_flight()}")
        return {name: {"payload": p.payload, "sample_ids": p.sample_ids} for name, p in self._parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._parts = {name: _Partition(s["payload"], list(s["sample_ids"]), True, True) for name, s in state.items()}

    def _require(self, partition: str) -> _Partition:
        if partition not in self._parts:
            raise DataPlaneError(f"no partition {partition}")
        return self._parts[partition]
