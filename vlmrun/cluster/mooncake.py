"""The job's mooncake_master: the Mooncake store's metadata server behind the `transfer_queue` plane's
`backend: mooncake`. One per job, on node 0; every client of the job reaches it over TCP.

1. Ports come from the job's port block (cluster/ray/nodes.py): the block's fixed part has 16 ports
   and Ray uses the first 8, so the master takes offsets 8 (RPC), 9 (HTTP metadata) and 10 (metrics
   and /health). Two jobs on one machine have different blocks, so their masters never collide. The
   HTTP metadata server binds 0.0.0.0 whatever host it is given (docs/measurements.md).
2. The master runs as our child in its own process group, blocking SIGUSR2 and SIGTERM (a job-wide
   stop signal is for the node's stop flag: the step in flight still needs the store), with eviction
   off (a full store fails a put; it never drops data). It dies with the thread that started it
   (PR_SET_PDEATHSIG: it ignores SIGTERM, so it must be SIGKILL), and it inherits the attempt's
   marker, so the attempt's reaper ends it too. `start_mooncake_master` returns once /health says the
   service is ready, or raises with the log's tail; `stop_mooncake_master` ends it by PID with
   SIGKILL (it keeps nothing worth a graceful exit) and reaps it; `MooncakeMaster.exited()` says, in
   one line, that it died.
3. Never TransferQueue's `auto_init`: it kills every mooncake_master on the host, other jobs' too.

The node starts it through `running_plane_servers` (cluster/plane_servers.py), for the
`transfer_queue` plane's `backend: mooncake`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmrun.cluster.ray.nodes import PortBlock, reachable, taken_ports
from vlmrun.plane.transfer_queue.endpoint import MooncakeStoreConfig

#: Offsets in the job's port block (module doc).
RPC_OFFSET, HTTP_METADATA_OFFSET, METRICS_OFFSET = 8, 9, 10
_STOP_S = 5.0
_PR_SET_PDEATHSIG = 1


class MooncakeError(RuntimeError):
    """mooncake_master could not be had: not installed, its port taken, or it did not become ready."""


@dataclass(frozen=True)
class MooncakePorts:
    rpc: int
    http_metadata: int
    metrics: int

    def all(self) -> list[int]:
        return [self.rpc, self.http_metadata, self.metrics]


def mooncake_ports(block: PortBlock) -> MooncakePorts:
    """The master's ports in `block`; refuses a block whose layout gives those ports to Ray."""
    ports = MooncakePorts(block.base + RPC_OFFSET, block.base + HTTP_METADATA_OFFSET, block.base + METRICS_OFFSET)
    ray_ports = set(block.fixed_ports(head=True)) | set(block.worker_ports)
    if ray_ports & set(ports.all()):
        raise MooncakeError(f"port block {block.base}: Ray uses ports {sorted(ray_ports & set(ports.all()))}")
    return ports


def free_mooncake_ports(block: PortBlock, host: str, *, tries: int = 8) -> MooncakePorts:
    """The master's ports in `block`, or, when something on `host` listens on one of them (another job
    whose block is the same one: a local job's id is its pid), in the next block whose master ports are
    free. Clients learn the ports from the master (`store_config`), so any free block serves."""
    taken = []
    for k in range(tries):
        ports = mooncake_ports(block.following(k))
        busy = taken_ports(host, ports.all())
        if not busy:
            return ports
        taken += busy
    raise MooncakeError(f"mooncake_master: every port block tried on {host} has a port taken ({tries} blocks: {taken})")


@dataclass
class MooncakeMaster:
    """A running mooncake_master (our child)."""

    host: str
    ports: MooncakePorts
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> str | None:
        """ "mooncake_master (pid, port) exited with ..." once it has ended, None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        return (
            f"mooncake_master (pid {self.pid}, port {self.ports.rpc} on {self.host}) exited with {how} "
            f"(its log: {self.log_path})"
        )

    def store_config(self, **sizes: int) -> MooncakeStoreConfig:
        """What the plane's clients need; `sizes` may set `segment_bytes` and `buffer_bytes`."""
        return MooncakeStoreConfig(
            master_address=f"{self.host}:{self.ports.rpc}",
            metadata_server=f"{self.host}:{self.ports.http_metadata}",
            **sizes,
        )


def mooncake_unavailable() -> str | None:
    """Why this machine cannot run Mooncake (the reason, for a skip or an error), or None when it can."""
    if master_binary() is None:
        return "mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return "Mooncake needs libibverbs.so.1 (Debian: apt-get install libibverbs1)"
    return None


def master_binary() -> Path | None:
    """The mooncake_master executable of the installed `mooncake` package (found without importing it)."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "mooncake_master"
        if path.is_file():
            return path
    return None


def start_mooncake_master(block: PortBlock, *, host: str, log_path: Path, deadline_s: float = 30.0) -> MooncakeMaster:
    """Start mooncake_master on `host` with the ports of `block`; return once it is ready.

    Raises MooncakeError when Mooncake is not installed, a port is taken, or the master exits or is not
    ready within `deadline_s` (the master is stopped then, and the message has its log's tail).
    """
    reason = mooncake_unavailable()
    if reason:
        raise MooncakeError(reason)
    ports = free_mooncake_ports(block, host)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            _command(master_binary(), host, ports),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=lambda: _as_job_server(parent),
        )
    master = MooncakeMaster(host=host, ports=ports, proc=proc, log_path=log_path)
    try:
        _wait_ready(master, deadline_s)
    except BaseException:
        stop_mooncake_master(master)
        raise
    return master


def stop_mooncake_master(master: MooncakeMaster | None, timeout_s: float = _STOP_S) -> None:
    """End the master by its PID (SIGKILL) and reap it; the store's data is gone. Close the plane's
    Mooncake clients first: a client left open retries the stopped master for ~20 s when it exits."""
    if master is None or master.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(master.pid, signal.SIGKILL)
    master.proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def running_mooncake_master(
    block: PortBlock, *, host: str, log_path: Path, deadline_s: float = 30.0
) -> Iterator[MooncakeMaster]:
    """`start_mooncake_master`, stopped when the block ends."""
    master = start_mooncake_master(block, host=host, log_path=log_path, deadline_s=deadline_s)
    try:
        yield master
    finally:
        stop_mooncake_master(master)


def master_healthy(master: MooncakeMaster, timeout_s: float = 1.0) -> bool:
    """True when the master's /health says it serves and its RPC and metadata ports accept connections."""
    url = f"http://{master.host}:{master.ports.metrics}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            health = json.loads(reply.read())
    except (OSError, ValueError):
        return False
    ports_up = all(reachable(master.host, p, timeout_s) for p in (master.ports.rpc, master.ports.http_metadata))
    return health.get("status") == "ok" and bool(health.get("service_ready")) and ports_up


def _command(binary: Path, host: str, ports: MooncakePorts) -> list[str]:
    return [
        str(binary),
        f"--rpc_address={host}",
        f"--rpc_port={ports.rpc}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={ports.http_metadata}",
        f"--metrics_host={host}",
        f"--metrics_port={ports.metrics}",
        "--enable_metric_reporting=false",
        "--eviction_high_watermark_ratio=1.0",
        "--eviction_ratio=0.0",
    ]


def _wait_ready(master: MooncakeMaster, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if master.proc.poll() is not None:
            raise MooncakeError(f"mooncake_master exited with {master.proc.returncode}:\n{_tail(master.log_path)}")
        if master_healthy(master, timeout_s=0.5):
            return
        time.sleep(0.1)
    raise MooncakeError(f"mooncake_master not ready within {deadline_s:.0f} s:\n{_tail(master.log_path)}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def _as_job_server(parent: int) -> None:
    """`preexec_fn` of the master (module doc); `parent` is the pid of the process that starts it."""
    # blocked, not only ignored: mooncake_master installs its own SIGTERM handler (a graceful exit)
    stop = (signal.SIGUSR2, signal.SIGTERM)
    for s in stop:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
