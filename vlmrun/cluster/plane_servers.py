"""The job's data-plane servers: started by node 0 around the driver, watched while it runs.

1. `running_plane_servers` starts nothing for `impl: local`, TransferQueue's controller and storage
   units (Ray actors, plane/transfer_queue/servers.py) for `impl: transfer_queue`, and
   mooncake_master first (cluster/mooncake.py) for `backend: mooncake`; it stops them in reverse
   order. It yields `PlaneServers`: the endpoint every client needs, and what runs.
2. A client of a dead server waits long (TransferQueue retries a put to a dead storage unit for
   3 x 200 s and waits for a dead controller forever; Mooncake clients retry a dead master for tens of
   seconds, then fail with a dump of keys). So the driver runs `watched(servers)`: a check every
   second (cluster/watchdog.py) ends it with `PlaneServerLost`, one line that names the server and
   where it ran, within seconds of its death. The attempt ends FAILED; `vlmrun resume` continues
   from the last checkpoint with fresh servers.

The node entrypoint, on node 0 after Ray is up:

    with running_plane_servers(dp.impl, dp.backend, block=port_block(job_id), host=node_ip,
                               log_dir=rd.path / "logs") as servers, watched(servers):
        ...  # the driver gets `servers.endpoint` (None for impl local) and hands it to every rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrun.cluster.mooncake import MooncakeError, MooncakeMaster, running_mooncake_master
from vlmrun.cluster.ray.nodes import PortBlock
from vlmrun.cluster.watchdog import FailFast
from vlmrun.errors import CheckFailed
from vlmrun.plane.transfer_queue.endpoint import TransferQueueEndpoint

if TYPE_CHECKING:  # servers.py imports TransferQueue and torch
    from vlmrun.plane.transfer_queue.servers import TransferQueueServers

#: how often the driver's watchdog looks at the servers
WATCH_PERIOD_S = 1.0


class PlaneServerLost(CheckFailed):
    """A server of the job's data plane died while the driver ran; the attempt fails (resumable)."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; `vlmrun resume` continues from the last checkpoint with fresh servers")


@dataclass
class PlaneServers:
    """What `running_plane_servers` started: `endpoint` for the clients (None for `impl: local`)."""

    endpoint: TransferQueueEndpoint | None = None
    master: MooncakeMaster | None = None
    transfer_queue: TransferQueueServers | None = None

    def lost(self) -> str | None:
        """The first server found dead, as one line ("... died" / "... exited with ..."); None while all run."""
        problem = self.master.exited() if self.master is not None else None
        if problem is None and self.transfer_queue is not None:
            problem = self.transfer_queue.lost()
        return problem


@contextlib.contextmanager
def running_plane_servers(
    impl: str,
    backend: str,
    *,
    block: PortBlock | None,
    host: str,
    log_dir: Path,
    storage_units: int = 1,
    **mooncake_sizes: int,
) -> Iterator[PlaneServers]:
    """The job's data-plane servers for `data_plane.impl` / `data_plane.backend` (module doc). Needs
    this process's Ray (node 0, after Ray is up). `block` (the job's port block) is needed for
    `backend: mooncake`; `mooncake_sizes` (`segment_bytes`, `buffer_bytes`) size every client's share
    of the Mooncake store. Close every plane client before the block ends."""
    if impl == "local":
        yield PlaneServers()
        return
    from vlmrun.plane.transfer_queue.servers import start_transfer_queue, stop_transfer_queue

    with contextlib.ExitStack() as stack:
        servers = PlaneServers()
        mooncake = None
        if backend == "mooncake":
            if block is None:
                raise MooncakeError("the mooncake backend needs the job's port block")
            servers.master = stack.enter_context(
                running_mooncake_master(block, host=host, log_path=log_dir / "mooncake-master.log")
            )
            mooncake = servers.master.store_config(**mooncake_sizes)
        tq = start_transfer_queue(backend, mooncake=mooncake, storage_units=storage_units)
        stack.callback(stop_transfer_queue, tq)
        servers.transfer_queue, servers.endpoint = tq, tq.endpoint
        yield servers


def watched(
    servers: PlaneServers, *, on_hard_exit: Callable[[str], None] | None = None, period_s: float = WATCH_PERIOD_S
) -> FailFast:
    """The body of this `with` ends with PlaneServerLost once a server of `servers` is gone (module doc).
    `on_hard_exit(reason)` runs before the process exits when the body does not stop within a minute
    (cluster/watchdog.py)."""
    return FailFast(
        servers.lost, PlaneServerLost, period_s=period_s, on_hard_exit=on_hard_exit, name="vlmrun-plane-watchdog"
    )
