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

from vlmrun.algorithms.common.loop import StepLoop
from vlmrun.algorithms.grpo.metrics import step_row
from vlmrun.algorithms.grpo.partition import ReplicaPlanes, StagePlane
from vlmrun.algorithms.grpo.stages import DriverStages, PlaneStages
from vlmrun.algorithms.grpo.worker import GrpoWorker
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.data.batch import SampleCounts
from vlmrun.run.rows import StepRow

log = logging.getLogger(__name__)


class GrpoController(StepLoop):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.planes: ReplicaPlanes | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def _start(self, found: Checkpoint | None) -> None:
        r = self.recipe
        enabled = r.data_plane.enabled
        optimizer_steps = self.steps.max_steps * r.grpo.inner_steps  # the LR schedule counts optimizer steps
        self._start_workers(
            GrpoWorker,
            optimizer_steps=optimizer_steps,
            plane_endpoint=self.plane_endpoint if enabled else None,
            plane_enabled=enabled,
        )
        n_micro = self.steps.micro_batches_per_replica
        if enabled:
            self._attach_loaders()
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
        super()._close()

    # ---- one step --------------------------------------------------------------------------------
    def _train_step(self, step: int, counters: dict) -> StepRow:
        t0 = time.perf_counter()
        record = self.stages.run(step)
        dt = time.perf_counter() - t0
        counters["consumed_samples"] += sum(len(r.prompts) for r in record.rollouts)  # fillers left out
        owned = [loader.counts() for loader in self.loaders.values()]
        counts = SampleCounts.total([r.loader_counts for r in record.rollouts] + owned)
        row = step_row(
            record,
            step=step,
            attempt=self.attempt,
            epoch=self.steps.epoch_of(step),
            step_s=dt,
            counters=counters,
            counts=counts,
        )
        counters["total_valid_tokens"] += row.valid_tokens
        return row
