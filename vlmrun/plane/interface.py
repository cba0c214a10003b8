"""The data-plane seam: what every algorithm talks to when bulk tensors move between stages.

A step's data is written once into a named partition, committed, read by the stages that need it,
then cleared; a checkpoint holds the committed partitions (normally none at a step boundary).
Adapters implement it: `local` (process-local, SFT v2 today); TransferQueue adapters (simple and
Mooncake storage) plug in here without the algorithms importing a backend package.
"""

from __future__ import annotations

import abc
from typing import Any


class DataPlaneError(RuntimeError):
    """A use of the plane that breaks its protocol (a second write, a read before commit, ...)."""


class DataPlane(abc.ABC):
    @abc.abstractmethod
    def put(self, partition: str, payload: Any, sample_ids: list[str]) -> None:
        """The one write of `partition`: its payload and the ids of the samples it carries."""

    @abc.abstractmethod
    def commit(self, partition: str) -> None:
        """Make a written partition readable."""

    @abc.abstractmethod
    def abort(self, partition: str) -> None:
        """Drop a partition whose write did not complete."""

    @abc.abstractmethod
    def get(self, partition: str) -> Any:
        """The payload of a committed partition."""

    @abc.abstractmethod
    def list_sample_ids(self, partition: str) -> list[str]:
        """The sample ids written into `partition`."""

    @abc.abstractmethod
    def clear(self, partition: str) -> None:
        """Forget `partition` (its readers are done)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The committed partitions, for a checkpoint; refuses while a write is in flight."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
