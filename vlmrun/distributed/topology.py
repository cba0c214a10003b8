"""Topology mapper: from the policy's rank layout to Energon loader shards.

One loader shard per data-parallel replica. Shard `d` is read by the replica's owner rank (the rank
with dp=d and tp=pp=cp=0) and its batches are delivered to every rank of that replica. Ranks are
counted as the layout counts them (config/layout.py: Megatron's default order "tp-cp-ep-dp-pp").
Two roles per replica (`Role`): its owner reads the loader and the data plane, holds the generation
engine and the sampling stream; its result rank (tp=cp=0 of the last pipeline stage) is where a
policy's numbers are whole (the loss, the logprobs), and where the worker group collects them from.
With tp = pp = cp = 1 both are the replica's one rank.

We compute that order ourselves instead of calling megatron-core's `RankGenerator`: megatron-core is an
optional GPU extra, and importing `megatron.core.parallel_state` pulls in torch (~3.5 s on CPU), too slow
for `vlmrun submit --dry-run` on a login node. tests/test_topology.py checks our rank groups against
`RankGenerator` whenever megatron-core is importable.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from vlmrun.config.layout import MEGATRON_ORDER, RankLayout

_PLAN_SCHEMA = "vlmrun.placement/1"


class Role(enum.Enum):
    """A rank's role in its data-parallel replica: the owner reads its data and holds its engine, the
    result rank (tp 0 of the last pipeline stage) holds the policy's numbers whole."""

    OWNER = "owner"
    RESULT = "result"


@dataclass(frozen=True, kw_only=True)
class LoaderShardPlacement:
    """Where one loader shard lives: `owner_rank` reads it, every rank of `delivery_ranks` gets it;
    `result_rank` holds the replica's results (`Role.RESULT`).

    `delivery_ranks` is ascending and holds the owner and the result rank.
    """

    shard: int
    num_shards: int
    owner_rank: int
    delivery_ranks: tuple[int, ...]
    result_rank: int

    def rank_of(self, role: Role) -> int:
        return self.owner_rank if role is Role.OWNER else self.result_rank


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """The loader shards of one layout, indexed by data-parallel rank; build it with `plan_placement`.

    `placement_hash` goes into every checkpoint: a resume compares it to refuse a changed topology.
    """

    layout: RankLayout
    shards: tuple[LoaderShardPlacement, ...]

    @cached_property
    def placement_hash(self) -> str:
        """First 16 hex digits of the sha256 of the plan's canonical JSON; stable across processes."""
        layout = self.layout
        payload = {
            "schema": _PLAN_SCHEMA,
            "order": MEGATRON_ORDER,
            "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp},
            "shards": [[s.shard, s.owner_rank, list(s.delivery_ranks)] for s in self.shards],
        }
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    @cached_property
    def loader_hash(self) -> str:
        """The placement a loader shard's fingerprint records: this layout's data-parallel part alone (its
        replicas, each as one rank), so that cutting a replica over other tp x pp ranks leaves its loader's
        state valid; with tp = pp = cp = 1 it is `placement_hash` itself."""
        layout = self.layout
        if (layout.tp, layout.pp, layout.cp) == (1, 1, 1):
            return self.placement_hash
        return plan_placement(RankLayout(dp=layout.dp, dp_shard=layout.dp_shard)).placement_hash

    def shard_of_rank(self, rank: int) -> int:
        """The loader shard whose batches `rank` receives (its dp index); ValueError if out of range."""
        return self.layout.coords(rank).dp

    def owner_of_shard(self, shard: int) -> int:
        """The global rank that runs loader `shard`; ValueError if there is no such shard."""
        if not 0 <= shard < len(self.shards):
            last = len(self.shards) - 1
            raise ValueError(f"shard {shard} does not exist: {self.describe()} has shards 0..{last}")
        return self.shards[shard].owner_rank

    @property
    def replica_size(self) -> int:
        """Ranks per data-parallel replica (tp x pp x cp)."""
        return len(self.shards[0].delivery_ranks)

    def describe(self) -> str:
        """One line naming the layout, e.g. "dp=2 tp=1 pp=1 cp=1 (2 ranks)"."""
        return self.layout.describe()


def plan_placement(layout: RankLayout) -> PlacementPlan:
    """One loader shard per data-parallel replica, ranks in Megatron's default order (see module doc)."""
    shards = tuple(
        LoaderShardPlacement(
            shard=dp,
            num_shards=layout.dp,
            owner_rank=layout.rank_of(dp=dp),
            delivery_ranks=layout.replica_ranks(dp),
            result_rank=layout.rank_of(dp=dp, pp=layout.pp - 1),
        )
        for dp in range(layout.dp)
    )
    return PlacementPlan(layout=layout, shards=shards)


def rng_source(layout: RankLayout, saved: dict) -> Callable[[int], int] | None:
    """rank -> the rank whose saved RNG it takes, from a checkpoint whose run identity is `saved`: None
    (each its own) at the layout that wrote it; at another tp x pp of the same dp (config/identity.py
    RELAYOUTABLE), its replica's owner as it was then (the rank that drew from the replica's streams)."""
    then = RankLayout(dp=layout.dp, tp=saved.get("parallel.tp") or 1, pp=saved.get("parallel.pp") or 1)
    if (then.tp, then.pp) == (layout.tp, layout.pp):
        return None
    return lambda rank: then.rank_of(dp=layout.coords(rank).dp)
