"""The worker group: one Ray actor per rank, placed by a placement group, and named ways to dispatch.

1. Placement: one placement group, a bundle per rank (one CPU, and one GPU on GPU runs). One rank
   per node when ranks and nodes match (STRICT_SPREAD: the 2-node dp=2 layout), spread over the
   nodes otherwise, packed on a single node. Ranks are ordered by node (`ranks_by_node`): a node's
   ranks are consecutive, in the order Ray placed the nodes, so an HSDP shard group (dp_shard
   consecutive ranks) stays on one node and its reduce-scatter never crosses the network.
2. Dispatch is a named strategy over the mesh's axes, not loop code repeated in every algorithm:
   `all_ranks` (every rank, same arguments), `per_rank` (every rank its own share),
   `replica_owners` (the owner rank of each data-parallel replica, e.g. to open its loader shard),
   `by_dp` / `submit_replica` (every rank gets its replica's part, e.g. its shard of a batch) and
   `replicas` (every rank of each replica its replica's part, the result of each replica's owner:
   a call whose collectives span the replica's tp and pp ranks, but whose result one rank has).
   Results come back in rank (or shard) order; `submit_*` return Ray object refs instead of waiting.
   `collect(results, role)` takes from per-rank results (rank order) the one of each replica's owner
   or result rank (topology.py's `Role`): what a replica computed once, from the rank that owns it.
   `gather(refs)` waits for refs; when a rank died, it raises the death, not the collective errors
   that the surviving ranks see a moment later (a gloo "Connection reset by peer" names no culprit).
3. Ranks meet in torch.distributed through `rendezvous()`: rank 0's node address and a free port
   there. Actor classes inherit `RankActor` for that.
4. An actor runs its calls one after the other, except the methods marked `side_call`: those run on
   one side thread, beside the call the actor is busy with (a signal to a rank that waits inside its
   stage, a read of its process-local plane while it computes).

Ray is imported where it is used, so the placement logic stays importable on a login node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmrun.distributed.topology import PlacementPlan, Role
from vlmrun.startup import freeze_heap


def gather(refs: Sequence, *, grace_s: float = 10.0) -> list:
    """`ray.get(refs)`, except that a dead actor is the error raised when any ref failed.

    `ray.get` raises the first failure in list order: when rank 1 is killed, rank 0's error ("Connection
    reset by peer" inside a collective) comes first. The death is the cause, so once anything failed,
    wait up to `grace_s` for the other refs and raise an actor death (or worker crash) if one is among them.
    """
    import ray

    refs = list(refs)
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as first:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as death:
                raise death from None
            except ray.exceptions.RayError:
                continue
        raise first from None


#: The Ray concurrency group of an actor's `side_call` methods: one thread beside the default group's.
SIDE_GROUP = "side"


def side_call(method: Callable) -> Callable:
    """Mark an actor method to run on the actor's side thread, beside the call its main thread is running
    rather than after it (module doc). It must be safe against that call: short, and touching only
    state made for both threads."""
    method._vlmrun_side_call = True  # type: ignore[attr-defined]
    return method


def remote_class(actor_cls: type):
    """`ray.remote(actor_cls)`, with a side thread when it has `side_call` methods."""
    import ray

    members = [getattr(actor_cls, name) for name in dir(actor_cls)]
    side = [fn for fn in members if getattr(fn, "_vlmrun_side_call", False)]
    if not side:
        return ray.remote(actor_cls)
    for fn in side:
        ray.method(concurrency_group=SIDE_GROUP)(fn)
    return ray.remote(concurrency_groups={SIDE_GROUP: 1})(actor_cls)


class StepGate:
    """The step a controller has let through (`open`, from a side call), for a stage call that waits
    for it (`wait`). Steps only grow; a step opened as failed raises in its waiters, and a wait gives
    up with TimeoutError after `timeout_s`."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._step: int | None = None
        self._ok = True

    def open(self, step: int, ok: bool) -> None:
        with self._cond:
            self._step, self._ok = step, ok
            self._cond.notify_all()

    def wait(self, step: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._step is not None and self._step >= step, self.timeout_s):
                raise TimeoutError(f"step {step}: no word from the controller in {self.timeout_s:.0f} s")
            if self._step == step and not self._ok:
                raise RuntimeError(f"step {step}: the controller's part of it failed (the controller says why)")


class RankActor:
    """What the group asks of every actor class: where the rank runs, a free port there, and
    `freeze_heap` once its set-up is done."""

    def freeze_heap(self) -> None:
        freeze_heap()

    def node_address(self) -> str:
        """The address other ranks reach this one at (127.0.0.1 on the embedded default)."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """How many nodes the ranks spread over and what one rank holds."""

    nodes: int
    gpus_per_rank: int = 0

    def strategy(self, world_size: int) -> str:
        if self.nodes > 1:
            return "STRICT_SPREAD" if world_size == self.nodes else "SPREAD"
        return "PACK"

    def bundle(self) -> dict[str, float]:
        return {"CPU": 1, "GPU": self.gpus_per_rank} if self.gpus_per_rank else {"CPU": 1}


def ranks_by_node(bundle_nodes: Sequence[str]) -> list[int]:
    """The bundle of each rank, given the node of each bundle: ranks fill one node's bundles before the
    next node's, nodes in the order of their first bundle (so rank 0 keeps bundle 0), bundles of a node
    in index order."""
    first: dict[str, int] = {}
    for index, node in enumerate(bundle_nodes):
        first.setdefault(node, index)
    return sorted(range(len(bundle_nodes)), key=lambda b: (first[bundle_nodes[b]], b))


class WorkerGroup:
    """One actor of `actor_cls` per rank of `plan`; `init(rank)` gives each actor's constructor kwargs.

    Raises `ray.exceptions.GetTimeoutError` when the placement group cannot be placed within
    `ready_timeout_s` (the cluster lacks the CPUs or GPUs). `shutdown()` ends the actors' work
    (their `shutdown` method) and frees the placement group.
    """

    def __init__(
        self,
        actor_cls: type,
        plan: PlacementPlan,
        placement: Placement,
        init: Callable[[int], dict[str, Any]],
        *,
        ready_timeout_s: float = 300.0,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.plan = plan
        world = plan.layout.world_size
        self.pg = placement_group([placement.bundle() for _ in range(world)], strategy=placement.strategy(world))
        ray.get(self.pg.ready(), timeout=ready_timeout_s)
        nodes = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        self.bundles = ranks_by_node([nodes[b] for b in range(world)])
        remote = remote_class(actor_cls)
        self.workers = [
            remote.options(
                num_cpus=1,
                num_gpus=placement.gpus_per_rank,
                scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=self.bundles[rank]
                    )
                ),
            ).remote(**init(rank))
            for rank in range(world)
        ]

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def node_addresses(self) -> list[str]:
        return self.all_ranks("node_address")

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) for `torch.distributed` init: rank 0's node and a port free there."""
        import ray

        return ray.get(self.workers[0].node_address.remote()), ray.get(self.workers[0].free_port.remote())

    # ---- dispatch --------------------------------------------------------------------------------
    def submit_all_ranks(self, method: str, *args, **kwargs) -> list:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def all_ranks(self, method: str, *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank; the results in rank order."""
        return gather(self.submit_all_ranks(method, *args, **kwargs))

    def submit_replica_owners(self, method: str, per_shard: Callable[[int], dict[str, Any]]) -> list:
        return [getattr(self.workers[s.owner_rank], method).remote(**per_shard(s.shard)) for s in self.plan.shards]

    def replica_owners(self, method: str, per_shard: Callable[[int], dict[str, Any]]) -> list:
        """`method(**per_shard(shard))` on the owner rank of each loader shard; results in shard order."""
        return gather(self.submit_replica_owners(method, per_shard))

    def submit_replica(self, shard: int, method: str, **kwargs) -> list:
        """`method(**kwargs)` on every rank of data-parallel replica `shard` (its part of a batch)."""
        return [getattr(self.workers[rank], method).remote(**kwargs) for rank in self.plan.shards[shard].delivery_ranks]

    def submit_by_dp(self, method: str, parts: Sequence[dict[str, Any]]) -> list:
        if len(parts) != len(self.plan.shards):
            raise ValueError(
                f"by_dp needs one part per data-parallel replica ({len(self.plan.shards)}), got {len(parts)}"
            )
        return [ref for s in self.plan.shards for ref in self.submit_replica(s.shard, method, **parts[s.shard])]

    def by_dp(self, method: str, parts: Sequence[dict[str, Any]]) -> list:
        """Every rank gets `parts[its dp index]` as keyword arguments; the results in shard, then rank order."""
        return gather(self.submit_by_dp(method, parts))

    def submit_replicas(self, method: str, per_shard: Callable[[int], dict[str, Any]]) -> list:
        """`method(**per_shard(shard))` on every rank of each replica; refs in shard, then rank order."""
        return [ref for s in self.plan.shards for ref in self.submit_replica(s.shard, method, **per_shard(s.shard))]

    def replicas(self, method: str, per_shard: Callable[[int], dict[str, Any]], role: Role = Role.OWNER) -> list:
        """`method(**per_shard(shard))` on every rank of each replica; the result of each replica's `role`
        rank, in shard order."""
        results = gather(self.submit_replicas(method, per_shard))
        ranks = [rank for s in self.plan.shards for rank in s.delivery_ranks]
        by_rank = dict(zip(ranks, results, strict=True))
        return [by_rank[s.rank_of(role)] for s in self.plan.shards]

    def collect(self, results: Sequence, role: Role) -> list:
        """From `results` in rank order (every rank's), each replica's `role` rank's, in shard order."""
        if len(results) != self.world_size:
            raise ValueError(f"collect needs every rank's result ({self.world_size}), got {len(results)}")
        return [results[s.rank_of(role)] for s in self.plan.shards]

    def on_rank(self, rank: int, method: str, **kwargs) -> Any:
        """`method(**kwargs)` on rank `rank` alone; its result."""
        return gather([getattr(self.workers[rank], method).remote(**kwargs)])[0]

    def per_rank(self, method: str, kwargs_of: Callable[[int], dict[str, Any]]) -> list:
        """`method(**kwargs_of(rank))` on every rank (each its own share); the results in rank order."""
        return gather([getattr(w, method).remote(**kwargs_of(rank)) for rank, w in enumerate(self.workers)])

    def shutdown(self) -> None:
        """Tell every actor to release what it holds (process groups, loader workers), then free the bundles."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.submit_all_ranks("shutdown"), timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
            remove_placement_group(self.pg)
