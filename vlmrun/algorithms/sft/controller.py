"""The SFT controller: one Ray actor that runs the step loop (common/loop.py) of SFT v1 or v2.

1. v1 (driver-fed): the controller owns the loader shards of all replicas, builds each step's
   micro-batches and ships each replica its shard's (`WorkerGroup.submit_replica`).
2. v2 (single controller, colocated loaders): the owner rank of each replica holds its own shard's
   loader (the topology mapper decides which); the controller sends "step" and receives metrics only.
3. Both read shard r of DP for replica r, and the loss is normalized by the step's global count of
   valid tokens, so on CPU with a fixed seed both loops give bitwise-identical losses.
4. A stop request (signal -> flag -> `request_stop`) is acted on at the next step boundary: every rank
   saves, and the run ends as STOPPED (resumable).
5. The controller talks to the ranks only through the worker group's dispatch, and to checkpoints
   only through the checkpoint store (parts: controller, and each loader shard in v1).
"""

from __future__ import annotations

import logging
import time

from vlmrun.algorithms.common.loop import StepLoop
from vlmrun.algorithms.sft.worker import SftWorker
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.data.batch import SampleCounts
from vlmrun.data.epochs import is_filler
from vlmrun.distributed.topology import Role
from vlmrun.distributed.worker_group import gather
from vlmrun.run.rows import StepRow

log = logging.getLogger(__name__)


class SftController(StepLoop):
    # ---- set-up ----------------------------------------------------------------------------------
    def _start(self, found: Checkpoint | None) -> None:
        """One SftWorker per rank, then the loader shards: in the owner ranks (v2) or here (v1)."""
        self._start_workers(SftWorker, optimizer_steps=self.steps.max_steps)
        if self.recipe.train.loop == "v2":
            self._attach_loaders()
        else:
            self.loaders = self._open_loader_shards()

    # ---- one step --------------------------------------------------------------------------------
    def _train_step(self, step: int, counters: dict) -> StepRow:
        t0 = time.perf_counter()
        n_micro = self.steps.micro_batches_per_replica
        if self.recipe.train.loop == "v1":
            refs, loader_s = [], 0.0
            for s in self.plan.shards:  # each replica starts as soon as its batch is built
                t1 = time.perf_counter()
                batches = [self.loaders[s.shard].next_batch() for _ in range(n_micro)]
                loader_s = max(loader_s, time.perf_counter() - t1)
                refs += self.group.submit_replica(s.shard, "train_step", step=step, micro_batches=batches)
            reports = gather(refs)
        else:
            reports = self.group.all_ranks("train_step", step, n_micro=n_micro)
            loader_s = max(r.loader_s for r in reports)
        dt = time.perf_counter() - t0
        if self.recipe.train.loop == "v1":
            reports = self._in_rank_order(reports)
        head = self.group.collect(reports, Role.RESULT)[0].result  # every replica's result rank has the step's
        ids = [i for r in reports for i in r.sample_ids]  # the owners' (each replica's samples once)
        fillers = {i for i in ids if is_filler(i)}  # vlmrun.data.epochs: repeats that train nothing
        samples = self.steps.global_batch_size - len(fillers)
        counters["consumed_samples"] += samples
        counters["total_valid_tokens"] += head.valid_tokens
        owned = [loader.counts() for loader in self.loaders.values()]
        counts = SampleCounts.total([r.loader_counts for r in reports] + owned)
        return StepRow(
            step=step,
            attempt=self.attempt,
            epoch=self.steps.epoch_of(step),
            loss=head.loss,
            grad_norm=head.grad_norm,
            lr=head.lr,
            valid_tokens=head.valid_tokens,
            consumed_samples=counters["consumed_samples"],
            dropped_samples=counts.dropped,
            truncated_samples=counts.truncated,
            sample_ids=[i for i in ids if i not in fillers],
            step_time_s=round(dt, 4),
            loader_latency_max_s=round(loader_s, 4),
            tokens_per_s=round(head.valid_tokens / dt, 2),
            samples_per_s=round(samples / dt, 2),
            peak_rss_mb=max(r.result.peak_rss_mb for r in reports),
        )

    def _in_rank_order(self, reports: list) -> list:
        """v1's reports (replica by replica, each in rank order) in rank order."""
        ranks = [rank for s in self.plan.shards for rank in s.delivery_ranks]
        return [report for _, report in sorted(zip(ranks, reports, strict=True), key=lambda pair: pair[0])]
