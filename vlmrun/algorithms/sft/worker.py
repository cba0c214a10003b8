"""SftWorker: the Ray actor of one SFT rank. It holds the rank's policy backend and, on the owner
rank of a replica in SFT v2, that replica's loader shard and data plane.

v1 (driver-fed): the step's micro-batches arrive with the call. v2 (colocated): the owner rank takes
them from its own loader shard and moves them through the process-local data plane, one partition
per step, written once, read, cleared; the controller only says "step".
"""

from __future__ import annotations

import time

import torch

from vlmrun.algorithms.common.checkpoint import Checkpoint, PendingCheckpoint
from vlmrun.algorithms.common.policy_parts import load_policy, save_policy
from vlmrun.distributed.worker_group import RankActor
from vlmrun.plane.interface import DataPlane
from vlmrun.plane.local import LocalDataPlane
from vlmrun.plane.micro_batches import get_micro_batches, put_micro_batches
from vlmrun.policy import rng
from vlmrun.policy.interface import PolicyBackend


class SftWorker(RankActor):
    def __init__(self, *, rank: int, world_size: int, recipe_json: str, model_dir: str, threads: int = 1):
        from vlmrun.config.recipe import Recipe
        from vlmrun.policy.hf import HfPolicy  # model.backend: hf is the one backend today

        torch.set_num_threads(threads)
        self.rank = rank
        self.recipe = Recipe.model_validate_json(recipe_json)
        self.model_dir = model_dir
        self.policy: PolicyBackend = HfPolicy.from_recipe(
            self.recipe, rank=rank, world_size=world_size, model_dir=model_dir
        )
        self.loader = None
        self.plane: DataPlane = LocalDataPlane()

    def setup(self, master_addr: str, master_port: int, max_steps: int) -> dict:
        return self.policy.setup(master_addr=master_addr, master_port=master_port, max_steps=max_steps)

    def attach_loader(self, shard: int, num_shards: int, placement_hash: str) -> None:
        """SFT v2: this rank owns loader shard `shard` of its replica."""
        from vlmrun.data.loader import open_loader_shard

        self.loader = open_loader_shard(
            self.recipe,
            processor_dir=self.model_dir,
            shard=shard,
            num_shards=num_shards,
            placement_hash=placement_hash,
            split=self.recipe.data.split,
        )

    def train_step(self, step: int, micro_batches: list | None = None, n_micro: int = 0) -> dict:
        """One optimizer step. v1 passes `micro_batches`; v2 passes `n_micro` and the owned loader fills the plane."""
        loader_s = 0.0
        if micro_batches is None:
            t0 = time.perf_counter()
            micro_batches = self._batches_through_plane(f"step-{step}", n_micro)
            loader_s = time.perf_counter() - t0
        result = self.policy.train_step(micro_batches)
        return {
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "valid_tokens": result.valid_tokens,
            "sample_ids": [i for b in micro_batches for i in b.sample_ids],
            "loader_counts": self.loader.counts() if self.loader is not None else None,
            "loader_s": loader_s,
            "compute_s": result.compute_s,
            "peak_rss_mb": result.peak_rss_mb,
        }

    def _batches_through_plane(self, partition: str, n_micro: int) -> list:
        family = self.recipe.model.family
        try:
            batches = [self.loader.next_batch() for _ in range(n_micro)]
            record_ids = put_micro_batches(self.plane, partition, batches, family)
            return get_micro_batches(self.plane, partition, record_ids, family)
        finally:
            self.plane.clear(partition)

    def validate(self, loss_batches: list, prompt_batches: list) -> list[float]:
        """This rank's [nll, tokens, correct, answered] over its share of the val batches."""
        return self.policy.score(loss_batches, prompt_batches)

    def save(self, pending: PendingCheckpoint) -> dict[str, dict]:
        """Write this rank's parts into `pending` (collective when the policy is sharded); returns
        {file: digest} of what this rank wrote."""
        written = save_policy(self.policy, pending, rank=self.rank)
        written |= pending.write("rng", rng.rng_state(), index=self.rank)
        if self.loader is not None:
            written |= pending.write("loader", self.loader.state_dict(), index=self.loader.shard)
            plane = self.plane.state_dict()
            if plane:
                written |= pending.write("plane", plane, index=self.loader.shard)
        return written

    def load(self, checkpoint: Checkpoint, restart_data: bool = False) -> None:
        """Restore this rank's parts; with `restart_data` (another dp wrote it) only the policy's."""
        load_policy(self.policy, checkpoint)
        if restart_data:
            return
        rng.set_rng_state(checkpoint.read("rng", index=self.rank))
        if self.loader is not None:
            self.loader.load_state_dict(checkpoint.read("loader", index=self.loader.shard))
            if checkpoint.has("plane", index=self.loader.shard):
                self.plane.load_state_dict(checkpoint.read("plane", index=self.loader.shard))

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.policy.shutdown()
