"""One GRPO step as the controller dispatches it: rollout, logprobs, advantages, train.

Two ways to move the step's samples, with the same stages on the same ranks and the same numbers:

1. `PlaneStages` (`data_plane.enabled: true`): every replica's owner rank reads its own loader
   shard and writes its rollout once into its partition; the ranks fetch the fields of their
   stage from the plane; the controller reads the rewards and writes the advantages there (through
   its own client, or the owner rank for a process-local plane). Only sample ids and small
   per-response reports (rewards, lengths, timings) come back to the controller. The advantage stage
   needs nothing the logprob stage writes, so it runs while the ranks compute their logprobs: it reads
   the rewards, computes and writes the advantages, and tells the ranks (`advantages_written`, which
   runs beside their stage). Both write the response samples, and a sample's writes must not overlap
   (interface.py, 5): a rank that has its logprobs waits for that word, then leaves their write and
   the train stage's read of its fields queued on its plane client, and returns. The train stage
   then waits for what of them has not arrived.
2. `DriverStages` (`data_plane.enabled: false`, for A/B runs): the controller holds the loader
   shards, and every stage's fields travel through it: the rollout comes back to the controller,
   which sends each stage exactly the fields the field registry gives that stage.

Both return a `StepRecord` for metrics.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vlmrun.algorithms.grpo.advantages import group_advantages
from vlmrun.algorithms.grpo.fields import GrpoStage
from vlmrun.algorithms.grpo.partition import ReplicaPlanes, partition_name, split_fields, stage_fields
from vlmrun.algorithms.grpo.reports import LogprobReport, RolloutReport, TrainReport
from vlmrun.algorithms.grpo.rollout_rows import RolloutRows
from vlmrun.distributed.worker_group import gather
from vlmrun.plane.interface import SampleBatch


@dataclass
class StepRecord:
    """What one step's stages reported: per replica (shard order) and per rank (by_dp order)."""

    rollouts: list[RolloutReport]
    logprobs: list[LogprobReport]
    trains: list[TrainReport]
    advantages: torch.Tensor
    walls: dict[GrpoStage, float] = field(default_factory=dict)  # seconds, as the controller saw them
    controller_plane: dict[str, float] = field(default_factory=dict)  # what the step waited for, all bytes
    controller_plane_beside: float = 0.0  # the controller's plane seconds, beside the ranks' logprobs
    loader_s: float = 0.0


@contextlib.contextmanager
def _timed(walls: dict[GrpoStage, float], stage: GrpoStage) -> Iterator[None]:
    """The block's wall seconds as `walls[stage]` (the stage as the controller sees it)."""
    t0 = time.perf_counter()
    yield
    walls[stage] = time.perf_counter() - t0


class PlaneStages:
    def __init__(self, recipe, group, planes: ReplicaPlanes, micro_batches_per_replica: int):
        self.recipe, self.group, self.planes = recipe, group, planes
        self.n_micro = micro_batches_per_replica

    def run(self, step: int) -> StepRecord:
        walls: dict[GrpoStage, float] = {}
        with _timed(walls, GrpoStage.ROLLOUT):
            # every rank of a replica refits; its owner reads, generates and reports (worker.py)
            rollouts = self.group.replicas("rollout", lambda shard: {"step": step, "n_micro": self.n_micro})
        ids = [r.sample_ids for r in rollouts]
        parts = [partition_name(step, shard) for shard in range(len(ids))]
        t0 = time.perf_counter()
        computing = self.group.submit_by_dp("logprob", [{"step": step, "sample_ids": i} for i in ids])
        written = False
        try:
            advantages = self._advantages(parts, ids)  # beside the ranks' logprobs (module doc)
            written = True
        finally:  # the ranks wait for this word either way
            told = self.group.submit_by_dp("advantages_written", [{"step": step, "ok": written}] * len(ids))
        beside_s, plane = time.perf_counter() - t0, self.planes.take()
        logprobs = gather(computing)
        gather(told)
        # the controller's plane time the step waited for: what of it outlasted the slowest rank's compute
        slowest = max(r.times[GrpoStage.LOGPROB] + r.plane["seconds"] for r in logprobs)
        waited = min(plane["seconds"], max(0.0, beside_s - slowest))
        walls[GrpoStage.LOGPROB] = time.perf_counter() - t0
        walls[GrpoStage.ADVANTAGE] = beside_s
        with _timed(walls, GrpoStage.TRAIN):
            trains = self.group.by_dp("train", [{"step": step, "sample_ids": i} for i in ids])
        return StepRecord(
            rollouts=rollouts,
            logprobs=logprobs,
            trains=trains,
            advantages=torch.cat(advantages),
            walls=walls,
            controller_plane={"seconds": waited, "bytes": plane["bytes"]},
            controller_plane_beside=plane["seconds"],
            loader_s=max(r.times["loader"] for r in rollouts),
        )

    def _advantages(self, parts: list[str], ids: list[list[str]]) -> list[torch.Tensor]:
        """The advantage stage: every replica's rewards from its partition, advantages back into it."""
        g = self.recipe.grpo
        got = self.planes.get_each(parts, ids, list(stage_fields(self.recipe, GrpoStage.ADVANTAGE)))
        adv = [group_advantages(b.stack("rewards"), g.num_generations, normalize_std=g.normalize_std) for b in got]
        self.planes.put_each(parts, ids, [{"advantages": list(a)} for a in adv])
        return adv


class DriverStages:
    def __init__(self, recipe, group, loaders: dict, micro_batches_per_replica: int):
        self.recipe, self.group, self.loaders = recipe, group, loaders
        self.n_micro = micro_batches_per_replica

    def run(self, step: int) -> StepRecord:
        g = self.recipe.grpo
        walls: dict[GrpoStage, float] = {}
        loader_s = [0.0]
        with _timed(walls, GrpoStage.ROLLOUT):
            rollouts = self.group.replicas(
                "rollout", lambda shard: {"step": step, "prompts": self._prompts(shard, loader_s)}
            )
        rows: list[RolloutRows] = [r.rows for r in rollouts]
        for r in rollouts:  # the record keeps the reports, not the rollout itself
            r.rows = None
        with _timed(walls, GrpoStage.LOGPROB):
            logprobs = self.group.by_dp("logprob", [self._stage_kwargs(step, r, GrpoStage.LOGPROB) for r in rows])
        for shard, r in enumerate(rows):
            r.responses.columns.update(self._replica_results(logprobs, shard).columns)
        advantages = []
        with _timed(walls, GrpoStage.ADVANTAGE):
            for r in rows:
                adv = group_advantages(r.responses.stack("rewards"), g.num_generations, normalize_std=g.normalize_std)
                r.responses.columns["advantages"] = list(adv)
                advantages.append(adv)
        with _timed(walls, GrpoStage.TRAIN):
            trains = self.group.by_dp("train", [self._stage_kwargs(step, r, GrpoStage.TRAIN) for r in rows])
        return StepRecord(
            rollouts=rollouts,
            logprobs=logprobs,
            trains=trains,
            advantages=torch.cat(advantages),
            walls=walls,
            loader_s=loader_s[0],
        )

    def _prompts(self, shard: int, loader_s: list[float]) -> list:
        t0 = time.perf_counter()
        prompts = [self.loaders[shard].next_batch() for _ in range(self.n_micro)]
        loader_s[0] = max(loader_s[0], time.perf_counter() - t0)
        return prompts

    def _stage_kwargs(self, step: int, rows: RolloutRows, stage: GrpoStage) -> dict:
        """Exactly the fields `stage` reads (as the plane would hand them over)."""
        prompt_fields, response_fields = split_fields(stage_fields(self.recipe, stage))

        def only(batch: SampleBatch, fields: list[str]) -> SampleBatch:
            return SampleBatch(sample_ids=list(batch.sample_ids), columns={f: batch.columns[f] for f in fields})

        sent = RolloutRows(prompts=only(rows.prompts, prompt_fields), responses=only(rows.responses, response_fields))
        return {"step": step, "sample_ids": list(rows.responses.sample_ids), "rows": sent}

    def _replica_results(self, results: list[LogprobReport], shard: int) -> LogprobReport:
        """The first rank's result of replica `shard` (by_dp returns shard, then rank order)."""
        per_replica = len(results) // len(self.group.plan.shards)
        return results[shard * per_replica]
