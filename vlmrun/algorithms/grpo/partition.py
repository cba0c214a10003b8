"""A step's GRPO partition in the data plane: its name, its spec, the fields each stage reads, and the
plane clients that count what they move.

1. One partition per step and replica, `grpo-step-<N>-replica-<r>`: a process-local plane (`local`)
   lives in the replica's owner rank, so a replica's samples stay in one partition on every adapter;
   the owner registers it and writes the rollout, and clears it after the train stage (the plane is
   empty at every step boundary).
2. Consumers: the logprob stage(s), the advantage stage (the controller) and the train stage. The
   field registry decides what each reads (`Stage`); without a KL penalty nobody writes
   `ref_logprobs`, so the train stage leaves it out of its list. A stage reads its prompt-aligned
   fields and media from the prompt samples and the rest from the response samples
   (rollout_rows.py), with one get each.
3. `StagePlane` wraps a client and counts the seconds spent in it and the bytes of the values that
   cross it (pixel values at the plane's pixel dtype); `take()` returns and resets the counts.
4. `ReplicaPlanes` is how the controller reaches replica r's partition: its own client of a shared
   plane (transfer_queue), or, for `local`, the owner rank's plane through a call to that rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlmrun.distributed.worker_group import gather
from vlmrun.plane.fields import FIELDS, Alignment, Stage
from vlmrun.plane.interface import DataPlane, PartitionSpec, SampleBatch


def partition_name(step: int, replica: int) -> str:
    return f"grpo-step-{step}-replica-{replica}"


def consumers(recipe) -> tuple[Stage, ...]:
    kl = (Stage.REF_LOGPROB,) if recipe.grpo.kl_coef > 0 else ()
    return (Stage.PREV_LOGPROB, *kl, Stage.ADVANTAGE, Stage.TRAIN)


def rollout_spec(recipe, num_samples: int) -> PartitionSpec:
    return PartitionSpec.for_stages(recipe.family, consumers(recipe), num_samples)


def stage_fields(recipe, stage: Stage) -> tuple[str, ...]:
    """What `stage` asks the plane for (module doc, 2)."""
    fields = rollout_spec(recipe, 1).stage_fields(stage)
    return tuple(f for f in fields if f != "ref_logprobs" or recipe.grpo.kl_coef > 0)


def split_fields(fields: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the fields prompt samples hold, the fields response samples hold) of `fields`, in order."""
    per_prompt = (Alignment.PROMPT_TOKEN, Alignment.MEDIA)
    return [f for f in fields if FIELDS[f].alignment in per_prompt], [
        f for f in fields if FIELDS[f].alignment not in per_prompt
    ]


def value_bytes(values: Mapping[str, Sequence[Any]], pixel_dtype: torch.dtype | None = None) -> int:
    """Bytes of per-sample values (tensors, or lists of media segments); pixel values at `pixel_dtype`."""
    total = 0
    for name, column in values.items():
        for value in column:
            for t in value if isinstance(value, (list, tuple)) else [value]:
                size = pixel_dtype.itemsize if name == "pixel_values" and pixel_dtype is not None else t.element_size()
                total += t.numel() * size
    return total


class StagePlane:
    """A data-plane client that counts what it moves (module doc, 3). Not thread-safe."""

    def __init__(self, plane: DataPlane, pixel_dtype: torch.dtype | None):
        self.plane, self.pixel_dtype = plane, pixel_dtype
        self._seconds, self._bytes = 0.0, 0

    @classmethod
    def open(cls, endpoint, *, pixel_dtype: torch.dtype | None) -> StagePlane:
        """A client of the job's plane (`endpoint`: the TransferQueue endpoint, None for `local`)."""
        from vlmrun.plane.adapters import open_plane

        return cls(open_plane(endpoint, pixel_dtype=pixel_dtype), pixel_dtype)

    def register(self, partition: str, spec: PartitionSpec) -> None:
        t0 = time.perf_counter()
        self.plane.register(partition, spec)
        self._seconds += time.perf_counter() - t0

    def put(self, partition: str, sample_ids: Sequence[str], columns: Mapping[str, Sequence[Any]]) -> None:
        t0 = time.perf_counter()
        self.plane.put(partition, list(sample_ids), columns)
        self._seconds += time.perf_counter() - t0
        self._bytes += value_bytes(columns, self.pixel_dtype)

    def get(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> SampleBatch:
        t0 = time.perf_counter()
        got = self.plane.get(partition, list(sample_ids), list(fields))
        self._seconds += time.perf_counter() - t0
        self._bytes += value_bytes(got.columns)
        return got

    def clear(self, partition: str) -> None:
        t0 = time.perf_counter()
        self.plane.clear(partition)
        self._seconds += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """{"seconds", "bytes"} moved since the last take."""
        out = {"seconds": self._seconds, "bytes": self._bytes}
        self._seconds, self._bytes = 0.0, 0
        return out

    def close(self) -> None:
        self.plane.close()


class ReplicaPlanes:
    """The controller's way to the replicas' partitions (module doc, 4); counts like `StagePlane`.

    `get_each` / `put_each` take one request per replica; through the owner ranks they run at once.
    """

    def __init__(self, group, *, shared: StagePlane | None):
        self.group, self.shared = group, shared
        self._seconds, self._bytes = 0.0, 0

    def get_each(self, partitions: list[str], sample_ids: list[list[str]], fields: list[str]) -> list[SampleBatch]:
        """Replica r's `fields` of `sample_ids[r]` from `partitions[r]`, for every replica r."""
        if self.shared is not None:
            return [self.shared.get(p, ids, fields) for p, ids in zip(partitions, sample_ids, strict=True)]
        got = self._through_owners(
            "plane_get", [(p, ids, fields) for p, ids in zip(partitions, sample_ids, strict=True)]
        )
        self._bytes += sum(value_bytes(g.columns) for g in got)
        return got

    def put_each(self, partitions: list[str], sample_ids: list[list[str]], columns: list[dict]) -> None:
        """Replica r's `columns[r]` for `sample_ids[r]` into `partitions[r]`, for every replica r."""
        requests = list(zip(partitions, sample_ids, columns, strict=True))
        if self.shared is not None:
            for p, ids, cols in requests:
                self.shared.put(p, ids, cols)
            return
        self._through_owners("plane_put", requests)
        self._bytes += sum(value_bytes(cols) for _, _, cols in requests)

    def _through_owners(self, method: str, requests: list[tuple]) -> list:
        t0 = time.perf_counter()
        owners = [self.group.workers[s.owner_rank] for s in self.group.plan.shards]
        out = gather([getattr(o, method).remote(*args) for o, args in zip(owners, requests, strict=True)])
        self._seconds += time.perf_counter() - t0
        return out

    def take(self) -> dict[str, float]:
        if self.shared is not None:
            return self.shared.take()
        out = {"seconds": self._seconds, "bytes": self._bytes}
        self._seconds, self._bytes = 0.0, 0
        return out

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
