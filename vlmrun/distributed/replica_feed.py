"""One reader per data-parallel replica, its data fed to the replica's other ranks.

A replica of tp x pp x cp ranks reads its loader shard and its data plane once, on its owner rank
(topology.py); every rank of the replica then runs the same micro-batches (its tensor-parallel and
pipeline collectives need them all). `ReplicaFeed.share` hands the owner's value to the others: one
object broadcast over a gloo group of the replica's ranks (CPU tensors, whatever the policy's device).
A layout whose replicas are one rank each needs none (`for_layout` returns None).
"""

from __future__ import annotations

from typing import Any

from vlmrun.config.layout import RankLayout


class ReplicaFeed:
    """This rank's replica group; build it with `for_layout` on every rank at once (collective)."""

    def __init__(self, group, owner: int, is_owner: bool):
        self.group, self.owner, self.is_owner = group, owner, is_owner

    @classmethod
    def for_layout(cls, layout: RankLayout, rank: int) -> ReplicaFeed | None:
        """The feed of `rank`'s replica, or None when each replica is one rank. Every rank of the run
        calls it at the same point: each replica's group is made by every rank, in replica order."""
        import torch.distributed as dist

        if layout.world_size == layout.dp:
            return None
        mine = layout.coords(rank).dp
        group = None
        for dp in range(layout.dp):
            made = dist.new_group(list(layout.replica_ranks(dp)), backend="gloo")
            if dp == mine:
                group = made
        owner = layout.rank_of(dp=mine)
        return cls(group, owner, rank == owner)

    def share(self, value: Any) -> Any:
        """The owner's `value` on every rank of the replica (the others pass None)."""
        import torch.distributed as dist

        payload = [value if self.is_owner else None]
        dist.broadcast_object_list(payload, src=self.owner, group=self.group)
        return payload[0]
