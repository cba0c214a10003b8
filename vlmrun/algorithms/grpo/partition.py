"""A step's GRPO partition in the data plane: its name, its spec, the fields each stage reads, and the
plane clients that count what they move.

1. One partition per step and replica, `grpo-step-<N>-replica-<r>`: a process-local plane (`local`)
   lives in the replica's owner rank, so a replica's samples stay in one partition on every adapter;
   the owner registers it and writes the rollout, and clears it after the train stage (the plane is
   empty at every step boundary).
2. Consumers: the logprob stage, the advantage stage (the controller) and the train stage; what each
   reads is fields.py's (without a KL penalty nobody writes `ref_logprobs`, and nobody reads it). A
   stage reads its prompt-aligned fields and media from the prompt samples and the rest from the
   response samples (rollout_rows.py), in one `get_many` (`StageGets`).
3. `StagePlane` wraps a client and counts the seconds spent in it and the bytes of the values that
   cross it (pixel values at the plane's pixel dtype); `take()` returns and resets the counts. Its
   calls run on a thread of their own, so a stage can leave round trips to run under its compute:
   the owner writes the prompt samples while it generates, a rank prefetches the train stage's prompt
   fields (written once, never changed) while it computes its logprobs, leaves the logprobs' write and
   the train stage's read of the response fields queued when it returns from that stage, and clears
   the partition while it trains. The seconds counted are the stage's waits for the plane.
4. `ReplicaPlanes` is how the controller reaches replica r's partition: its own client of a shared
   plane (transfer_queue), or, for `local`, the owner rank's plane through a call to that rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from vlmrun.algorithms.grpo.fields import GrpoStage, partition_spec, stage_reads, stage_writes
from vlmrun.algorithms.grpo.rollout_rows import join, prompt_of
from vlmrun.plane.fields import FIELDS, Alignment
from vlmrun.plane.interface import DataPlane, Get, PartitionSpec, Put, SampleBatch


def partition_name(step: int, replica: int) -> str:
    return f"grpo-step-{step}-replica-{replica}"


def rollout_spec(recipe, num_samples: int) -> PartitionSpec:
    return partition_spec(recipe.family, kl=recipe.grpo.kl_coef > 0, num_samples=num_samples)


def stage_fields(recipe, stage: GrpoStage) -> tuple[str, ...]:
    """What `stage` asks the plane for (module doc)."""
    return stage_reads(stage, recipe.family, kl=recipe.grpo.kl_coef > 0)


def split_fields(fields: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the fields prompt samples hold, the fields response samples hold) of `fields`, in order."""
    per_prompt = (Alignment.PROMPT_TOKEN, Alignment.MEDIA)
    return [f for f in fields if FIELDS[f].alignment in per_prompt], [
        f for f in fields if FIELDS[f].alignment not in per_prompt
    ]


@dataclass(frozen=True)
class StageGets:
    """A stage's requests for one replica's samples (module doc), by when their fields are written:
    the response fields the rollout wrote, those written since (the logprob and advantage stages' own;
    None for the logprob stage, which reads none), and the prompt samples' fields. A rank prefetches
    each part as soon as its fields are in the partition (module doc)."""

    rollout: Get
    later: Get | None
    prompts: Get

    @classmethod
    def of(cls, recipe, partition: str, response_ids: Sequence[str], stage: GrpoStage) -> StageGets:
        prompt_fields, response_fields = split_fields(stage_fields(recipe, stage))
        written = stage_writes(GrpoStage.ROLLOUT, recipe.family, kl=recipe.grpo.kl_coef > 0)
        rollout = [f for f in response_fields if f in written]
        later = [f for f in response_fields if f not in rollout]
        return cls(
            rollout=Get(partition, list(response_ids), rollout),
            later=Get(partition, list(response_ids), later) if later else None,
            prompts=Get(partition, prompt_of(response_ids), prompt_fields),
        )

    def all(self) -> list[Get]:
        return [g for g in (self.rollout, self.later, self.prompts) if g is not None]

    @staticmethod
    def joined(got: list[SampleBatch]) -> SampleBatch:
        """What `get_many(all())` returned, as one batch: every response with its prompt's fields."""
        *responses, prompts = got
        merged = SampleBatch(sample_ids=list(responses[0].sample_ids), columns={})
        for batch in responses:
            merged.columns.update(batch.columns)
        return join(prompts, merged)


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
    """A data-plane client of one process that counts what it moves, and overlaps its round trips with
    the caller's compute (module doc). Calls run in order, on the plane's own thread (or, while it
    is idle, on the caller's): `register`, `put_many`, `get_many` and `clear` wait for theirs (and so
    for all queued before it); with `wait=False` they queue theirs and return; `prefetch` queues a
    get whose result the next `get_many` of the same request takes; `flush` waits for everything
    queued. An error of a queued call is raised by the next wait. Seconds are the caller's waits:
    what the plane adds to a stage.
    """

    def __init__(self, plane: DataPlane, pixel_dtype: torch.dtype | None):
        self.plane, self.pixel_dtype = plane, pixel_dtype
        self._seconds, self._bytes = 0.0, 0
        threads = torch.get_num_threads()  # the plane thread reports (and restores) the caller's count
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="plane", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._queued: list[Future] = []
        self._nbytes: dict[Future, int] = {}  # what a queued put moves, counted once it succeeded
        self._prefetched: dict[tuple, tuple[Future, int]] = {}  # request -> (its get_many, its index)

    @classmethod
    def open(cls, endpoint, *, pixel_dtype: torch.dtype | None) -> StagePlane:
        """A client of the job's plane (`endpoint`: the TransferQueue endpoint, None for `local`)."""
        from vlmrun.plane.adapters import open_plane

        return cls(open_plane(endpoint, pixel_dtype=pixel_dtype), pixel_dtype)

    def register(self, partition: str, spec: PartitionSpec, *, wait: bool = True) -> None:
        self._call(self.plane.register, partition, spec, wait=wait)

    def put(self, partition: str, sample_ids: Sequence[str], columns: Mapping[str, Sequence[Any]]) -> None:
        self.put_many([Put(partition, list(sample_ids), columns)])

    def put_many(self, requests: Sequence[Put], *, wait: bool = True) -> None:
        nbytes = sum(value_bytes(r.columns, self.pixel_dtype) for r in requests)
        self._call(self.plane.put_many, list(requests), wait=wait, nbytes=nbytes)

    def get_many(self, requests: Sequence[Get]) -> list[SampleBatch]:
        """What each request gets, in order; a prefetched request's result is taken, not fetched again."""
        ready = {i: self._prefetched.pop(_key(r)) for i, r in enumerate(requests) if _key(r) in self._prefetched}
        rest = [r for i, r in enumerate(requests) if i not in ready]
        fetched = iter(self._now(self.plane.get_many, rest) if rest else [])
        got = []
        for i in range(len(requests)):
            if i in ready:
                future, index = ready[i]
                got.append(self._wait(future)[index])
            else:
                got.append(next(fetched))
        self._bytes += sum(value_bytes(g.columns) for g in got)
        return got

    def prefetch(self, requests: Sequence[Get]) -> None:
        """Queue `requests` (in one `get_many`); a later `get_many` takes any of them."""
        future = self._submit(self.plane.get_many, list(requests))
        self._prefetched |= {_key(r): (future, i) for i, r in enumerate(requests)}

    def clear(self, partition: str, *, wait: bool = True) -> None:
        """Clear `partition`; prefetches from it that nobody took are dropped."""
        self._prefetched = {k: f for k, f in self._prefetched.items() if k[0] != partition}
        self._call(self.plane.clear, partition, wait=wait)

    def flush(self) -> None:
        """Wait for every queued call; raise the first error."""
        if self._queued:
            self._wait(self._queued[-1])

    def serve(self, method: str, *args) -> Any:
        """`plane.<method>(*args)` on the plane thread, in order, uncounted: for a caller in another
        process that counts its own time (the controller's reach into a process-local plane). Its error
        goes to that caller alone."""
        return self._thread.submit(getattr(self.plane, method), *args).result()

    def take(self) -> dict[str, float]:
        """{"seconds", "bytes"} moved since the last take."""
        out = {"seconds": self._seconds, "bytes": self._bytes}
        self._seconds, self._bytes = 0.0, 0
        return out

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._prefetched.clear()
            self._thread.submit(self.plane.close).result()
            self._thread.shutdown()

    def _call(self, fn, *args, wait: bool, nbytes: int = 0) -> None:
        """`fn(*args)`, waited for or queued; `nbytes` count once it has succeeded."""
        if wait:
            self._now(fn, *args, nbytes=nbytes)
        else:
            self._submit(fn, *args, nbytes=nbytes)

    def _now(self, fn, *args, nbytes: int = 0) -> Any:
        """`fn(*args)` for a caller that waits for it: on the caller's thread when the plane thread is idle
        (two thread hops fewer), else queued behind what runs there."""
        if any(not f.done() for f in self._queued):
            return self._wait(self._submit(fn, *args, nbytes=nbytes))
        self._raise_queued()
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        finally:
            self._seconds += time.perf_counter() - t0
        self._bytes += nbytes
        return out

    def _submit(self, fn, *args, nbytes: int = 0) -> Future:
        future = self._thread.submit(fn, *args)
        self._queued.append(future)
        self._nbytes[future] = nbytes
        return future

    def _wait(self, future: Future) -> Any:
        """`future`'s result, after raising the first error of a call queued before it."""
        t0 = time.perf_counter()
        try:
            wait([future])
        finally:
            self._seconds += time.perf_counter() - t0
        self._raise_queued(but=future)
        return future.result()

    def _raise_queued(self, but: Future | None = None) -> None:
        """Forget the queued calls that are done; raise the first error among them (but `but`'s)."""
        done = [f for f in self._queued if f.done()]
        self._queued = [f for f in self._queued if not f.done()]
        for f in done:
            moved = self._nbytes.pop(f, 0)
            if f.exception() is None:
                self._bytes += moved
        for f in done:
            if f is not but and f.exception() is not None:
                raise f.exception()


def _key(r: Get) -> tuple:
    return (r.partition, tuple(r.sample_ids), tuple(r.fields))


class ReplicaPlanes:
    """The controller's way to the replicas' partitions (module doc); counts like `StagePlane`.

    `get_each` / `put_each` take one request per replica, and run them at once: side by side in one
    client of a shared plane (`get_many` / `put_many`), or through the owner ranks.
    """

    def __init__(self, group, *, shared: StagePlane | None):
        self.group, self.shared = group, shared
        self._seconds, self._bytes = 0.0, 0

    def get_each(self, partitions: list[str], sample_ids: list[list[str]], fields: list[str]) -> list[SampleBatch]:
        """Replica r's `fields` of `sample_ids[r]` from `partitions[r]`, for every replica r."""
        if self.shared is not None:
            return self.shared.get_many([Get(p, ids, fields) for p, ids in zip(partitions, sample_ids, strict=True)])
        got = self._through_owners(
            "plane_get",
            [
                {"partition": p, "sample_ids": ids, "fields": fields}
                for p, ids in zip(partitions, sample_ids, strict=True)
            ],
        )
        self._bytes += sum(value_bytes(g.columns) for g in got)
        return got

    def put_each(self, partitions: list[str], sample_ids: list[list[str]], columns: list[dict]) -> None:
        """Replica r's `columns[r]` for `sample_ids[r]` into `partitions[r]`, for every replica r."""
        requests = list(zip(partitions, sample_ids, columns, strict=True))
        if self.shared is not None:
            self.shared.put_many([Put(p, ids, cols) for p, ids, cols in requests])
            return
        self._through_owners(
            "plane_put", [{"partition": p, "sample_ids": ids, "columns": cols} for p, ids, cols in requests]
        )
        self._bytes += sum(value_bytes(cols) for _, _, cols in requests)

    def _through_owners(self, method: str, requests: list[dict]) -> list:
        """`method(**requests[r])` on replica r's owner rank, for every replica r; results in replica order."""
        t0 = time.perf_counter()
        out = self.group.replica_owners(method, lambda shard: requests[shard])
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
