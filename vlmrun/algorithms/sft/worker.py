"""SftWorker: the Ray actor of one SFT rank (a `RankWorker`: policy, validation, checkpoints). On the
owner rank of a replica in SFT v2 it also holds that replica's loader shard and data plane.

v1 (driver-fed): the step's micro-batches arrive with the call, on every rank of the replica. v2
(colocated): the owner rank takes them from its own loader shard and moves them through the
process-local data plane, one partition per step, written once, read, cleared, then hands them to the
replica's other ranks (a tensor- or pipeline-parallel replica: `RankWorker.from_owner`); the
controller only says "step". Only the owner's report names the samples (`SftStepReport.sample_ids`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vlmrun.algorithms.common.worker import RankWorker
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.checkpoint.write import PendingCheckpoint
from vlmrun.config.families import family_spec
from vlmrun.data.batch import SampleCounts
from vlmrun.plane.interface import DataPlane
from vlmrun.policy.interface import StepResult

# The rank's own tools (packing, the plane, micro-batches: torch) are imported where a rank uses them:
# the controller imports this module for the class alone, and holds no torch (common/loop.py).


@dataclass(frozen=True)
class SftStepReport:
    """One rank's part of an SFT step: the policy's result, the ids it trained on, and (v2) how long
    the rank waited for its loader."""

    result: StepResult
    sample_ids: list[str]
    loader_s: float = 0.0
    loader_counts: SampleCounts | None = None  # the owned loader shard's totals (v2)


class SftWorker(RankWorker):
    def __init__(self, **kwargs):
        from vlmrun.plane.local import LocalDataPlane

        super().__init__(**kwargs)
        self.plane: DataPlane = LocalDataPlane()

    def train_step(self, step: int, micro_batches: list | None = None, n_micro: int = 0) -> SftStepReport:
        """One optimizer step. v1 passes `micro_batches`; v2 passes `n_micro` and the owned loader fills the plane."""
        loader_s = 0.0
        if micro_batches is None:
            t0 = time.perf_counter()
            if self.loader is not None:
                micro_batches = self._batches_through_plane(f"step-{step}", n_micro)
            micro_batches = self.from_owner(micro_batches)
            loader_s = time.perf_counter() - t0
        if self.recipe.data.pack_by == "tokens":
            micro_batches = self._by_tokens(micro_batches)
        result = self.policy.train_step(micro_batches)
        counts = self.loader.counts() if self.loader is not None else None
        ids = [i for b in micro_batches for i in b.sample_ids] if self.owner else []
        return SftStepReport(result, ids, loader_s, counts)

    def _by_tokens(self, micro_batches: list) -> list:
        """The step's micro-batches as rows of at most data.pack_tokens tokens (`data.pack_by: tokens`),
        as many on this rank as on the rank that fills the most (a collective: every rank asks)."""
        from vlmrun.data.packing import by_tokens, rows_for

        d = self.recipe.data
        family = family_spec(self.recipe.model.family)
        count = self.most_over_ranks(rows_for(micro_batches, d.pack_tokens))
        return by_tokens(
            micro_batches, row_tokens=d.pack_tokens, count=count, pad_token_id=self.pad_token_id, family=family
        )

    def _batches_through_plane(self, partition: str, n_micro: int) -> list:
        from vlmrun.plane.micro_batches import get_micro_batches, put_micro_batches

        family = self.recipe.model.family
        try:
            batches = [self.loader.next_batch() for _ in range(n_micro)]
            record_ids = put_micro_batches(self.plane, partition, batches, family)
            return get_micro_batches(self.plane, partition, record_ids, family)
        finally:
            self.plane.clear(partition)

    def _save_own(self, pending: PendingCheckpoint) -> dict[str, dict]:
        """The owned replica's data-plane state, where it is not empty."""
        plane = self.plane.state_dict() if self.loader is not None else {}
        return pending.write("plane", plane, index=self.loader.shard) if plane else {}

    def _load_own(self, checkpoint: Checkpoint) -> None:
        if self.loader is not None and checkpoint.has("plane", index=self.loader.shard):
            self.plane.load_state_dict(checkpoint.read("plane", index=self.loader.shard))
