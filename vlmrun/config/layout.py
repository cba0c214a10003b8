"""The rank layout: how many ranks a run has along each parallel axis, and where each rank sits.

One type for everyone who reasons about ranks: the topology mapper (loader shards, placement hash),
the worker group (one actor per rank), the memory-fit check (what a rank's shard of the state is) and
the policy's device mesh (HSDP). The recipe's `parallel` section gives it (`ParallelConfig.layout`).

Ranks follow Megatron's default order "tp-cp-ep-dp-pp": tp fastest, pp slowest. Expert parallelism
does not add ranks: experts are spread over groups of `ep` ranks carved out of cp x dp (Megatron's
expert ranks, with the expert tensor-parallel size equal to tp), so `ep` changes which experts a rank
holds, never which rank reads which data. No backend shards experts yet: `ep` is 1 on every run.
Light on purpose (no torch): a login node plans placements with it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The order ranks are counted in, fastest axis first (Megatron's default).
MEGATRON_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True, kw_only=True)
class RankCoords:
    """A rank's index along each axis; `ep` is its place in its expert-parallel group."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int = 0


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Sizes of the data, tensor, pipeline, context and expert parallel axes, and HSDP's shard group.

    `dp_shard` None: one shard group of every dp rank (plain FSDP, or replicas). ValueError for a size
    below 1, a `dp_shard` that does not divide dp, or an `ep` that does not divide cp x dp.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int | None = None

    def __post_init__(self) -> None:
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        if self.dp_shard is not None:
            sizes["dp_shard"] = self.dp_shard
        small = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if small:
            raise ValueError(f"layout sizes are integers >= 1: {small}")
        if self.dp % self.shard_group:
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp}")
        if (self.cp * self.dp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide cp x dp = {self.cp * self.dp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks one copy of the sharded state is spread over: dp_shard under HSDP, else every dp rank."""
        return self.dp_shard or self.dp

    @property
    def replicas(self) -> int:
        """Copies of the sharded state (HSDP's replicate dimension; 1 for plain FSDP)."""
        return self.dp // self.shard_group

    def coords(self, rank: int) -> RankCoords:
        """Where `rank` sits (module doc); ValueError if there is no such rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} does not exist: {self.describe()} has ranks 0..{self.world_size - 1}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return RankCoords(tp=tp, cp=cp, dp=dp, pp=pp, ep=(cp + self.cp * dp) % self.ep)

    def rank_of(self, *, dp: int, tp: int = 0, cp: int = 0, pp: int = 0) -> int:
        """The rank at these coordinates (the inverse of `coords`)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def replica_ranks(self, dp: int) -> tuple[int, ...]:
        """The ranks of data-parallel replica `dp` (every tp, cp and pp index), ascending."""
        # pp outermost, tp innermost: the ranks come out ascending.
        return tuple(
            self.rank_of(dp=dp, tp=tp, cp=cp, pp=pp)
            for pp in range(self.pp)
            for cp in range(self.cp)
            for tp in range(self.tp)
        )

    def describe(self) -> str:
        """One line for error messages and the checkpoint's record, e.g. "dp=2 tp=1 pp=1 cp=1 (2 ranks)"."""
        ranks = "rank" if self.world_size == 1 else "ranks"
        hsdp = f" dp_shard={self.dp_shard}" if self.dp_shard else ""
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        return f"dp={self.dp}{hsdp} tp={self.tp} pp={self.pp} cp={self.cp}{experts} ({self.world_size} {ranks})"
