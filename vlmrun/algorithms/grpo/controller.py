"""The GRPO controller: one Ray actor that runs the sync GRPO loop (the step loop of common/loop.py).

1. Workers: one `GrpoWorker` per rank (the worker group places them); each holds its policy and,
   colocated, its replica's generation backend. On the embedded default (2 CPUs, dp=2) that asks
   Ray for nothing beyond the ranks' CPUs, and generation, logprobs and training take turns on them
   as sync GRPO does anyway; the generation backend is refit from the policy in memory.
2. Data: with the data plane (stages.PlaneStages) every owner rank reads its replica's loader shard;
   without it (stages.DriverStages) the controller holds the shards and every batch goes through it.
3. A step: rollout -> prev (and ref) logprobs -> group-normalized advantages -> clipped PG step(s);
   the step's partitions are empty again at its end.
4. Checkpoints hold what SFT's do, plus each replica's sampling stream ("generation"), so a resumed
   run samples the responses an uninterrupted one would.
"""

from __future__ import annotations

import logging
import time

from vlmrun.algorithms.common.checkpoint import Checkpoint
from vlmrun.algorithms.common.loop import StepLoop
from vlmrun.algorithms.grpo.metrics import step_row
from vlmrun.algorithms.grpo.partition import ReplicaPlanes, StagePlane
from vlmrun.algorithms.grpo.stages import DriverStages, PlaneStages
from vlmrun.algorithms.grpo.worker import GrpoWorker
from vlmrun.data.batch import SampleCounts
from vlmrun.distributed.worker_group import Placement, WorkerGroup

log = logging.getLogger(__name__)


class GrpoController(StepLoop):
    def __init__(self, *, plane_endpoint=None, **kwargs):
        super().__init__(**kwargs)
        self.plane_endpoint = plane_endpoint  # the job's TransferQueue endpoint; None for `local`
        self.loaders: dict = {}
        self.planes: ReplicaPlanes | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def _start(self, found: Checkpoint | None) -> None:
        r = self.recipe
        enabled = r.data_plane.enabled
        owners = {s.owner_rank: s.shard for s in self.plan.shards}
        replica_of = {rank: s.shard for s in self.plan.shards for rank in s.delivery_ranks}
        init = dict(
            world_size=self.plan.layout.world_size,
            recipe_json=self.recipe_json,
            model_dir=self.model_dir,
            threads=self.worker_threads,
            plane_endpoint=self.plane_endpoint if enabled else None,
            plane_enabled=enabled,
        )
        c = r.cluster
        self.group = WorkerGroup(
            GrpoWorker,
            self.plan,
            Placement(nodes=c.nodes, gpus_per_rank=1 if c.gpus_per_node else 0),
            init=lambda rank: dict(init, rank=rank, replica=replica_of[rank], owner=rank in owners),
        )
        self.worker_nodes = self.group.node_addresses()
        addr, port = self.group.rendezvous()
        optimizer_steps = self.steps.max_steps * r.grpo.inner_steps  # the LR schedule counts optimizer steps
        self.group.all_ranks("setup", addr, port, optimizer_steps)
        n_micro = self.steps.micro_batches_per_replica
        if enabled:
            self.group.replica_owners(
                "attach_loader",
                lambda shard: dict(
                    shard=shard, num_shards=self.plan.layout.dp, placement_hash=self.plan.placement_hash
                ),
            )
            shared = None
            if self.plane_endpoint is not None:
                shared = StagePlane.open(self.plane_endpoint, pixel_dtype=None)
            self.planes = ReplicaPlanes(self.group, shared=shared)
            self.stages = PlaneStages(r, self.group, self.planes, n_micro)
        else:
            self.loaders = self._open_loader_shards()
            self.stages = DriverStages(r, self.group, self.loaders, n_micro)

    def _close(self) -> None:
        if self.planes is not None:
            self.planes.close()
        self.group.shutdown()
        for loader in self.loaders.values():
            loader.close()

    # ---- one step --------------------------------------------------------------------------------
    def _train_step(self, step: int, counters: dict) -> dict:
        t0 = time.perf_counter()
        record = self.stages.run(step)
        dt = time.perf_counter() - t0
        counters["consumed_samples"] += self.steps.global_batch_size
        row = step_row(
            record, step=step, attempt=self.attempt, epoch=self.steps.epoch_of(step), step_s=dt, counters=counters
        )
        counters["total_valid_tokens"] += row["valid_tokens"]
        owned = [loader.counts() for loader in self.loaders.values()]
        return row | SampleCounts.total([r["loader_counts"] for r in record.rollouts] + owned).metrics()
