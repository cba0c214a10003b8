"""TransferQueue's servers as Ray actors of the job: start them, hand out the endpoint, stop them.

Called once per job by whoever starts Ray (the node entrypoint, or a test), after Ray is up:

    servers = start_transfer_queue("simple")                       # or "mooncake", mooncake=master.store_config()
    plane = TransferQueuePlane(servers.endpoint, pixel_dtype=...)  # in any process of the job
    ...
    stop_transfer_queue(servers)

Unlike `tq.init`, the actors ask Ray for no CPU (`tq.init` hangs forever when Ray has no free CPU for
its controller and storage units), carry no global name (two deployments may share one Ray), wait for
readiness with a deadline, and never touch mooncake_master (cluster/mooncake.py owns it).

A client of a dead server waits long (a put to a dead storage unit retries for 3 x 200 s; a call to a
dead controller has no timeout at all), so whoever started the servers watches them: `lost()` names
the first actor Ray reports dead, with its process and node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlmrun.plane.transfer_queue.endpoint import (
    BACKENDS,
    Backend,
    MooncakeStoreConfig,
    ServerAddress,
    TransferQueueEndpoint,
)

log = logging.getLogger(__name__)

_SHUTDOWN_S = 15.0
_PING_S = 5.0
#: how long the servers may take to come up: 15-17 s here with the CPUs busy with two test workers
#: (2 cores), past 60 s in CI with three; a cold import of torch from a shared file system is slow too
START_DEADLINE_S = 180.0


@dataclass(frozen=True)
class ServerActor:
    """One of the job's TransferQueue actors, and where it runs: what a message about it names."""

    what: str  # "the TransferQueue controller", "the TransferQueue storage unit storage-0"
    handle: Any
    actor_id: str = ""
    pid: int = 0
    node_ip: str = ""

    def describe(self) -> str:
        return f"{self.what} (actor {self.actor_id[:12]}, pid {self.pid} on {self.node_ip})"


@dataclass
class TransferQueueServers:
    """The job's TransferQueue actors; `endpoint` is what every client needs (picklable)."""

    endpoint: TransferQueueEndpoint
    controller: Any
    storage_units: dict[str, Any] = field(default_factory=dict)
    actors: list[ServerActor] = field(default_factory=list)

    def lost(self, timeout_s: float = _PING_S) -> str | None:
        """ "<actor> died" for the first actor Ray reports dead, or None while all answer (or are
        too busy to answer within `timeout_s`: only a death counts)."""
        import ray

        pings = [a.handle.__ray_ready__.remote() for a in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for actor, ping in zip(self.actors, pings, strict=True):
            if ping not in ready:
                continue
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError:
                return f"{actor.describe()} died"
        return None


def start_transfer_queue(
    backend: Backend,
    *,
    mooncake: MooncakeStoreConfig | None = None,
    storage_units: int = 1,
    storage_node_resource: str | None = None,
    deadline_s: float = START_DEADLINE_S,
) -> TransferQueueServers:
    """Start the controller and, for `backend="simple"`, `storage_units` in-memory storage units spread
    round-robin over the Ray nodes (those with `storage_node_resource` when given), all at once: each
    actor's process imports TransferQueue (torch, tensordict), so they start side by side.

    Needs a running Ray (`ray.init` in this process). `mooncake` (the running master's addresses) is
    required for `backend="mooncake"`. Raises TimeoutError naming the actor that is not ready after
    `deadline_s` (one bound for them all), having stopped what it started.
    """
    if backend not in BACKENDS:
        raise ValueError(f"TransferQueue backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if (backend == "mooncake") != (mooncake is not None):
        raise ValueError("give `mooncake` (the master's addresses) exactly when backend is 'mooncake'")
    import ray

    controller = ray.remote(_server_host("controller")).options(num_cpus=0).remote(polling_mode=False)
    servers = TransferQueueServers(endpoint=None, controller=controller)  # type: ignore[arg-type]
    try:
        if backend == "simple":
            servers.storage_units = _start_storage_units(storage_units, storage_node_resource)
        end = time.monotonic() + deadline_s
        controller_info = _ready(controller, "the TransferQueue controller", end, deadline_s)
        unit_infos = {
            name: _ready(h, f"storage unit {name}", end, deadline_s) for name, h in servers.storage_units.items()
        }
        servers.actors = [
            _located(controller, "the TransferQueue controller"),
            *(_located(h, f"the TransferQueue storage unit {name}") for name, h in servers.storage_units.items()),
        ]
    except BaseException:
        stop_transfer_queue(servers)
        raise
    servers.endpoint = TransferQueueEndpoint(
        backend=backend, controller=controller_info, storage_units=unit_infos, mooncake=mooncake
    )
    return servers


def stop_transfer_queue(servers: TransferQueueServers) -> None:
    """Shut the storage units down (their data is gone) and end every actor `start_transfer_queue` made."""
    import ray

    units = list(servers.storage_units.values())
    with contextlib.suppress(Exception):
        ray.get([u.shutdown.remote() for u in units], timeout=_SHUTDOWN_S)
    for actor in [*units, servers.controller]:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    servers.storage_units = {}


def _start_storage_units(n: int, node_resource: str | None) -> dict[str, Any]:
    import ray

    if n < 1:
        raise ValueError(f"storage_units must be at least 1, not {n}")
    config = {"total_storage_size": None, "num_data_storage_units": n, "_run_id": uuid.uuid4().hex}
    unit = ray.remote(_server_host("storage"))
    return {
        f"storage-{i}": unit.options(num_cpus=0, scheduling_strategy=strategy).remote(config=config)
        for i, strategy in enumerate(_round_robin(n, node_resource))
    }


def _round_robin(n: int, node_resource: str | None) -> list[Any]:
    """One hard node affinity per storage unit, over the alive nodes (those with `node_resource`) in
    node-id order, round-robin: each node gets floor(n / nodes) or ceil(n / nodes) units."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(
        node["NodeID"]
        for node in ray.nodes()
        if node.get("Alive") and (node_resource is None or node.get("Resources", {}).get(node_resource, 0) > 0)
    )
    if not nodes:
        raise RuntimeError(
            f"no alive Ray node {'has the resource ' + repr(node_resource) if node_resource else 'is up'}"
            " for a TransferQueue storage unit"
        )
    return [NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=False) for i in range(n)]


#: server -> (module, class) of the TransferQueue actor it is
_SERVERS = {
    "controller": ("transfer_queue.controller", "TransferQueueController"),
    "storage": ("transfer_queue.storage.simple_storage", "SimpleStorageUnit"),
}


class _ServerHost:
    """A TransferQueue server built in the actor's own process from the constructor's keywords: the
    process that starts the servers (the node) never imports TransferQueue, which pulls in torch,
    tensordict and torch._dynamo: seconds of CPU at every attempt's start. The actor's process
    takes TransferQueue with one thread (TQ_NUM_THREADS) and, as a Ray worker of ours, its imports
    with the cyclic collector paused (vlmrun/startup.py) until the server is built. Ray's calls on it
    (`address`, `shutdown`, `__ray_call__`) reach the server; its clients talk ZMQ."""

    server: str

    def __init__(self, **kwargs):
        import importlib

        from vlmrun.startup import freeze_heap

        # one deserializing thread (TransferQueue's default 8 warns on small nodes), read at its import
        os.environ["TQ_NUM_THREADS"] = "1"
        module, name = _SERVERS[self.server]
        actor_class = getattr(importlib.import_module(module), name)
        cls = actor_class.__ray_actor_class__  # the class under TransferQueue's @ray.remote (Ray 2.60's
        # ActorClass attribute: every TransferQueue test starts its servers through here)
        if self.server == "controller":
            from transfer_queue.sampler import SequentialSampler

            kwargs.setdefault("sampler", SequentialSampler())
        self.inner = cls(**kwargs)
        freeze_heap()

    def address(self) -> ServerAddress:
        """The server's ZMQ address as plain data: the caller unpickles nothing of TransferQueue's."""
        return ServerAddress.of(self.inner.get_zmq_server_info())

    def shutdown(self):
        return self.inner.shutdown()


def _server_host(server: str) -> type:
    """The actor class of `server`, named as TransferQueue's own (Ray's process titles and failure
    headers read `ray::TransferQueueController`, `ray::SimpleStorageUnit` as before)."""
    name = _SERVERS[server][1]
    return type(name, (_ServerHost,), {"server": server, "__doc__": _ServerHost.__doc__})


def _located(actor: Any, what: str) -> ServerActor:
    import ray

    actor_id, pid, node_ip = ray.get(actor.__ray_call__.remote(_whereabouts), timeout=_PING_S)
    return ServerActor(what, actor, actor_id, pid, node_ip)


def _whereabouts(_actor: Any) -> tuple[str, int, str]:
    """Run inside an actor (`__ray_call__`): its actor id, process id and node address."""
    import ray

    return ray.get_runtime_context().get_actor_id(), os.getpid(), ray.util.get_node_ip_address()


def _ready(actor: Any, what: str, end: float, deadline_s: float) -> Any:
    """The actor's ZMQ address, once it answers; TimeoutError once the monotonic clock passes `end`."""
    import ray

    try:
        return ray.get(actor.address.remote(), timeout=max(end - time.monotonic(), 0.0))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"{what} did not start within {deadline_s:.0f} s: its process imports TransferQueue and"
            " torch; is the node's CPU busy, or Ray short of nodes or memory?"
        ) from None
