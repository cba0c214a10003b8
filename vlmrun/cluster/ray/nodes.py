"""The Ray processes of one node of a SLURM job: their ports, their environment, start and end.

1. Ports: one block of `BLOCK_SIZE` ports per job, derived from the job id (`port_block`), every port
   explicit (GCS, raylet, object manager, agents, metrics, worker range). Jobs whose
   ids differ by less than `n_blocks()` never share a block; a block whose ports are taken on a node
   is refused by name before Ray starts there.
2. `ray start ... --block` runs as a child in its own process group, ignoring SIGUSR2 (a stop signal
   sent to every process of the job must reach only the node entrypoint's handler). This process
   becomes a child subreaper, so every Ray process the child spawns stays our descendant; teardown
   ends exactly those (TERM, then KILL). Never `ray stop`: it ends every user's Ray on the host.
3. The environment of our Ray: `RAY_AUTH_MODE=disabled` (a private cluster inside the allocation), no
   usage stats, on 127.0.0.1 `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` so Ray stays on loopback, and
   `GLOO_SOCKET_IFNAME` = the interface of the node's address (gloo's collectives between nodes).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vlmrun.cluster.reaper import TEMP_ENV
from vlmrun.startup import WORKER_SETUP_HOOK

PORT_BASE = 10240  # below the Linux ephemeral range (32768+), above well-known services
PORT_END = 32768
BLOCK_SIZE = 256  # 16 fixed ports + 240 worker ports per node
_FIXED = (
    "gcs",
    "node_manager",
    "object_manager",
    "dashboard_agent_listen",
    "dashboard_agent_grpc",
    "runtime_env_agent",
    "metrics_export",
)
_WORKER_OFFSET = 16


@dataclass(frozen=True)
class PortBlock:
    """The ports one node of one job uses: `base` .. `base + BLOCK_SIZE - 1`."""

    base: int

    def port(self, name: str) -> int:
        return self.base + _FIXED.index(name)

    @property
    def worker_ports(self) -> range:
        return range(self.base + _WORKER_OFFSET, self.base + BLOCK_SIZE)

    def following(self, k: int) -> PortBlock:
        """The block `k` blocks after this one, wrapping round the port range."""
        index = (self.base - PORT_BASE) // BLOCK_SIZE
        return PortBlock(PORT_BASE + (index + k) % n_blocks() * BLOCK_SIZE)

    def fixed_ports(self, head: bool) -> list[int]:
        names = _FIXED if head else [n for n in _FIXED if n != "gcs"]
        return [self.port(n) for n in names]

    def start_args(self, head: bool) -> list[str]:
        args = [
            f"--node-manager-port={self.port('node_manager')}",
            f"--object-manager-port={self.port('object_manager')}",
            f"--dashboard-agent-listen-port={self.port('dashboard_agent_listen')}",
            f"--dashboard-agent-grpc-port={self.port('dashboard_agent_grpc')}",
            f"--runtime-env-agent-port={self.port('runtime_env_agent')}",
            f"--metrics-export-port={self.port('metrics_export')}",
            f"--min-worker-port={self.worker_ports.start}",
            f"--max-worker-port={self.worker_ports.stop - 1}",
        ]
        if head:
            args += [
                f"--port={self.port('gcs')}",
                "--include-dashboard=false",
                # No autoscaler monitor: an allocation's size is fixed, nothing to scale, and vlmrun reads
                # nothing the monitor reports; it would be one more Python process at every attempt's start.
                # A hidden flag of `ray start` (2.60): tests/test_slurm_cluster.py sees the head without it.
                # (No Ray Client server either: start.py leaves it out.)
                "--no-monitor",
            ]
        return args


def n_blocks() -> int:
    return (PORT_END - PORT_BASE) // BLOCK_SIZE


def port_block(job_id: str) -> PortBlock:
    """The job's port block: consecutive job ids get distinct blocks (array tasks count too)."""
    parts = [int(p) for p in re.findall(r"\d+", str(job_id))] or [0]
    key = parts[0] + sum(parts[1:])
    return PortBlock(PORT_BASE + (key % n_blocks()) * BLOCK_SIZE)


def taken_ports(ip: str, ports: list[int]) -> list[int]:
    """The ports of `ports` that a socket at `ip` listens on (TIME_WAIT leftovers count as free)."""
    busy = []
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # like Ray's gRPC servers: a port left in TIME_WAIT (our own previous attempt) is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, p))
            except OSError:
                busy.append(p)
    return busy


def become_subreaper() -> None:
    """Orphans of our Ray processes re-parent to us, so teardown still finds them (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _ignore_stop_in_child() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SIGTERM's disposition is inherited (see stop_ray_node)


def start_ray_node(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`ray start ... --block` (less the head's API and Ray Client servers: start.py) as a child in its own
    process group, output to `log_path`."""
    cmd = [
        sys.executable,
        "-m",
        "vlmrun.cluster.ray.start",
        "start",
        *args,
        "--block",
        "--disable-usage-stats",
        "--log-style=record",
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
            preexec_fn=_ignore_stop_in_child,
        )


def stop_ray_node(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> int:
    """SIGKILL `proc`, its process group, its descendants and Ray orphans re-parented to us; returns the count.

    SIGKILL, not SIGTERM: our Ray processes inherit SIG_IGN for SIGTERM (the node entrypoint ignores
    the stop signals before Ray starts, so a job-wide SIGTERM leaves Ray up for the last checkpoint).
    Ray workers run in process groups of their own, hence the walk over descendants.
    """
    if proc is None:
        return 0
    import psutil

    victims = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        victims = [root, *root.children(recursive=True)]
    seen = {p.pid for p in victims}
    victims += [p for p in psutil.Process().children() if p.pid not in seen and _is_ray_process(p)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(victims, timeout=timeout_s)  # also reaps those that are our children
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    return len(victims)


def _is_ray_process(p) -> bool:
    import psutil

    try:
        name = p.name()
    except psutil.Error:
        return False
    return name.startswith("ray::") or name in ("raylet", "gcs_server")


#: Ray's worker process set-up hook, given by environment: every worker a raylet starts inherits the
#: raylet's environment, prestarted ones included, and runs the hook before it imports any actor's code.
#: (`ray.init(runtime_env={"worker_process_setup_hook": ...})` sets the same variable, but for the job's
#: runtime environment only, whose workers cannot be the raylet's prestarted ones: each is started twice.)
SETUP_HOOK_ENV = {"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": WORKER_SETUP_HOOK}


def ray_env(ip: str) -> dict[str, str]:
    """Environment for our Ray processes and the driver: private cluster, no telemetry, gloo on `ip`'s
    interface, our workers' set-up hook."""
    # "0" keeps a one-node Ray on loopback (docs/measurements.md: else Ray rewrites 127.0.0.1 to the outward address);
    # "1" (Linux's default) is required to join nodes, even where the local default said "0"
    env = {
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0" if ip.startswith("127.") else "1",
        **SETUP_HOOK_ENV,
    }
    iface = interface_of(ip)
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface  # collectives between nodes go where the node address lives
    return env


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` on this node (in this network namespace)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def job_temp_dir(job_id: str, nodename: str) -> Path:
    """A short per-job, per-node Ray temp dir (unix socket paths are limited to 107 bytes).

    Inside a node process: `ray` under the attempt's temp root, which the attempt's reaper removes.
    """
    attempt_root = os.environ.get(TEMP_ENV)
    if attempt_root:
        return Path(attempt_root) / "ray"
    root = Path(tempfile.gettempdir())
    if len(str(root)) > 40:
        root = Path("/tmp")
    return root / f"vlmrun-ray-{job_id}-{nodename}"[:80]


def node_resource(nodename: str) -> str:
    return "vlmrun_node_" + re.sub(r"[^A-Za-z0-9_]", "_", nodename)


def reachable(ip: str, port: int, timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections at ip:port."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False
