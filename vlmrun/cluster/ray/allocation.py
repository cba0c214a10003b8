"""Ray across the nodes of a SLURM allocation: node 0 runs the head and the driver, the others join.

1. Every node runs the node entrypoint (one SLURM task per node). `SlurmAllocation.from_env()` says
   which node this is; node 0 enters `ray_head(...)`, every other node calls `serve_worker(...)`.
   `run_on_allocation(payload, ...)` does both in one call (tests, `probe_nodes`).
2. Addresses: a node's address is its SLURM `NodeAddr` (see slurm_env.py), never the machine's
   outward address. A job on one node may use 127.0.0.1; several nodes need their own addresses.
3. Rendezvous through files in a folder all nodes see (under the run dir), one folder per job id and
   restart: the head writes `head.json` (address, port block) once its GCS answers; workers then run
   `ray start --address` and wait for `done`; each worker keeps `worker-<node>.json` saying what it
   is doing or why it failed, and `ray-<node>.log` holds each node's `ray start` output.
4. Node 0 waits until every node registered with its CPUs and GPUs (each node carries a
   `vlmrun_node_<name>` resource), with a deadline; the error names the nodes that did not join and
   what they last said. It then connects this process (`ray.init(address=...)`).
5. While the driver runs, a watchdog fails the job fast when a node leaves Ray or a worker reports
   that its Ray died: it interrupts the driver, which sees RayNodeLost (a clear message), not a hang.
6. On the way out node 0 writes `done` (workers tear down and exit 0) and ends the Ray processes it
   started; ports, processes and signals are handled in nodes.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from vlmrun.cluster.ray.nodes import (
    BLOCK_SIZE,
    PortBlock,
    become_subreaper,
    job_temp_dir,
    node_resource,
    port_block,
    ray_env,
    reachable,
    start_ray_node,
    stop_ray_node,
    taken_ports,
)
from vlmrun.cluster.ray.watchdog import NodeWatchdog, RayNodeLost, read_status, registered_nodes
from vlmrun.cluster.reaper import TEMP_ENV
from vlmrun.cluster.slurm_env import SlurmAllocation, node_address
from vlmrun.errors import CheckFailed
from vlmrun.run.directory import write_atomic

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.2


class RayBringUpError(CheckFailed):
    """Ray did not come up across the allocation (a node did not join, a port is taken, the head died)."""


@dataclass
class RayAllocationInfo:
    """What the driver on node 0 gets: the Ray address and the nodes that joined."""

    address: str
    head_ip: str
    nodes: list[str]
    temp_dir: Path
    ready_s: float
    ports: PortBlock


def _node_args(
    alloc: SlurmAllocation,
    ip: str,
    ports: PortBlock,
    temp: Path,
    *,
    head: bool,
    num_cpus: int | None,
    num_gpus: int | None,
) -> list[str]:
    return [
        f"--node-ip-address={ip}",
        f"--temp-dir={temp}",
        f"--num-cpus={num_cpus if num_cpus is not None else alloc.cpus_on_node}",
        f"--num-gpus={num_gpus if num_gpus is not None else alloc.gpus_on_node}",
        f"--resources={json.dumps({node_resource(alloc.nodename): 1})}",
        *ports.start_args(head),
    ]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- node 0: head + driver


@contextlib.contextmanager
def ray_head(
    alloc: SlurmAllocation,
    rendezvous_root: Path,
    *,
    deadline_s: float = 180.0,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> Iterator[RayAllocationInfo]:
    """Start the head on node 0, wait for every node, connect this process (`ray.init`), yield.

    Raises RayBringUpError (a node did not join within `deadline_s`, naming it; a port is taken) and,
    from the body, RayNodeLost when a node leaves while the driver runs. On exit, whatever happened,
    tells the workers `done` and ends every Ray process this call started.
    """
    t0 = time.monotonic()
    rdv = alloc.rendezvous(rendezvous_root)
    rdv.mkdir(parents=True, exist_ok=True)
    temp = job_temp_dir(alloc.job_id, alloc.nodename)
    log_path = rdv / f"ray-{alloc.nodename}.log"
    proc, outcome = None, "failed"
    try:
        nodes = alloc.hostnames()
        ip = _checked_address(alloc, len(nodes))
        ports = _free_block(port_block(alloc.job_id), alloc, ip, head=True)
        os.environ.update(ray_env(ip))
        become_subreaper()
        args = ["--head", *_node_args(alloc, ip, ports, temp, head=True, num_cpus=num_cpus, num_gpus=num_gpus)]
        proc = start_ray_node(args, dict(os.environ), log_path)
        address = f"{ip}:{ports.port('gcs')}"
        _wait_for_head(proc, ip, ports.port("gcs"), log_path, t0 + deadline_s)
        write_atomic(
            rdv / "head.json",
            json.dumps({"address": address, "port_base": ports.base, "node": alloc.nodename, "time": time.time()}),
        )
        import ray

        ray.init(address=address, _node_ip_address=ip, log_to_driver=True, configure_logging=False)
        want_cpus = num_cpus if num_cpus is not None else alloc.cpus_on_node
        want_gpus = num_gpus if num_gpus is not None else alloc.gpus_on_node
        _wait_for_nodes(nodes, rdv, want_cpus, want_gpus, t0 + deadline_s, deadline_s)
        info = RayAllocationInfo(address, ip, nodes, temp, time.monotonic() - t0, ports)
        log.info("Ray ready on %d node(s) (%s) in %.1fs at %s", len(nodes), ", ".join(nodes), info.ready_s, address)
        with NodeWatchdog(info.nodes, rdv, proc):
            yield info
        outcome = "ok"
    finally:
        _shutdown_driver()
        write_atomic(rdv / "done", json.dumps({"outcome": outcome, "time": time.time()}))
        stop_ray_node(proc)
        if outcome == "ok":
            _remove_tree(temp)
        elif proc is not None and TEMP_ENV not in os.environ:  # a node's attempt temp root goes with its reaper
            log.info("Ray logs of node %s kept in %s and %s", alloc.nodename, temp, log_path)


def _free_block(ports: PortBlock, alloc: SlurmAllocation, ip: str, *, head: bool) -> PortBlock:
    busy = taken_ports(ip, ports.fixed_ports(head=head))
    if busy:
        last = ports.base + BLOCK_SIZE - 1
        raise RayBringUpError(
            f"job {alloc.job_id}: Ray ports {busy} (block {ports.base}-{last}) are in use on "
            f"{alloc.nodename} ({ip}); another job uses this block"
        )
    return ports


def _checked_address(alloc: SlurmAllocation, n_nodes: int) -> str:
    ip = node_address(alloc.nodename)
    if n_nodes > 1 and ip.startswith("127."):
        raise RayBringUpError(
            f"node {alloc.nodename} has address {ip}: Ray across {n_nodes} nodes needs each "
            "node's own address (SLURM NodeAddr); on the local cluster start it with "
            "SLURM_NNODES=2 SLURM_NETNS=1 tools/slurm/up.sh"
        )
    return ip


def _wait_for_head(proc: subprocess.Popen, ip: str, port: int, log_path: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RayBringUpError(f"the Ray head exited with code {proc.returncode}: {_tail(log_path)}")
        if reachable(ip, port):
            return
        time.sleep(POLL_S)
    raise RayBringUpError(f"the Ray head did not answer on {ip}:{port} in time: {_tail(log_path)}")


def _wait_for_nodes(nodes: list[str], rdv: Path, cpus: int, gpus: int, deadline: float, deadline_s: float) -> None:
    while True:
        found = registered_nodes(nodes)
        short = {
            n: e for n, e in found.items() if e["Resources"].get("CPU", 0) < cpus or e["Resources"].get("GPU", 0) < gpus
        }
        failed = {n: s for n in nodes if (s := read_status(rdv / f"worker-{n}.json")) and s.get("state") == "failed"}
        if failed:
            said = "; ".join(f"{n}: {s.get('reason')}" for n, s in failed.items())
            raise RayBringUpError(f"Ray did not come up: {said}")
        if len(found) == len(nodes) and not short:
            return
        if time.monotonic() >= deadline:
            raise RayBringUpError(_missing_message(nodes, found, short, rdv, cpus, gpus, deadline_s))
        time.sleep(POLL_S)


def _missing_message(nodes, found, short, rdv: Path, cpus: int, gpus: int, deadline_s: float) -> str:
    parts = []
    for n in nodes:
        if n in short:
            r = short[n]["Resources"]
            parts.append(
                f"{n} joined with CPU={r.get('CPU', 0):g} GPU={r.get('GPU', 0):g}, expected CPU={cpus} GPU={gpus}"
            )
        elif n not in found:
            status = read_status(rdv / f"worker-{n}.json")
            said = f"last said: {status.get('state')}" if status else "its node entrypoint never reported"
            parts.append(f"{n} did not join ({said})")
    missing = [n for n in nodes if n not in found or n in short]
    return (
        f"Ray did not come up within {deadline_s:g}s: {len(missing)} of {len(nodes)} node(s) missing "
        f"[{', '.join(missing)}]: " + "; ".join(parts)
    )


def _shutdown_driver() -> None:
    if "ray" in sys.modules:
        import ray

        with contextlib.suppress(Exception):
            if ray.is_initialized():
                ray.shutdown()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- nodes 1..N-1: join and wait


def serve_worker(
    alloc: SlurmAllocation,
    rendezvous_root: Path,
    *,
    deadline_s: float = 180.0,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    head_lost_s: float = 30.0,
    linger_s: float = 20.0,
) -> int:
    """Join the head of this job and block until node 0 says done; returns 0, raises on failure.

    Raises RayBringUpError (no head within `deadline_s`, ports taken, `ray start` died) and
    RayNodeLost (the head stopped answering for `head_lost_s` without saying done). Either way this
    node's status file tells node 0 why, every Ray process started here is ended, and the raise
    waits up to `linger_s` for node 0's `done`: srun's --kill-on-bad-exit would otherwise end node 0
    before it recorded the failure.
    """
    rdv = alloc.rendezvous(rendezvous_root)
    status = rdv / f"worker-{alloc.nodename}.json"

    def report(state: str, reason: str = "") -> None:
        write_atomic(status, json.dumps({"state": state, "reason": reason, "time": time.time()}))

    rdv.mkdir(parents=True, exist_ok=True)
    report("waiting for the head")
    proc = None
    try:
        head = _wait_for_head_file(rdv, time.monotonic() + deadline_s, alloc)
        if head is None:
            return 0
        ip = _checked_address(alloc, alloc.num_nodes)
        ports = _free_block(PortBlock(int(head["port_base"])), alloc, ip, head=False)
        os.environ.update(ray_env(ip))
        become_subreaper()
        temp = job_temp_dir(alloc.job_id, alloc.nodename)
        log_path = rdv / f"ray-{alloc.nodename}.log"
        args = [
            f"--address={head['address']}",
            *_node_args(alloc, ip, ports, temp, head=False, num_cpus=num_cpus, num_gpus=num_gpus),
        ]
        proc = start_ray_node(args, dict(os.environ), log_path)
        report("started")
        _block_until_done(rdv, proc, head["address"], log_path, head_lost_s)
        _remove_tree(temp)
        return 0
    except (RayBringUpError, RayNodeLost) as e:
        report("failed", str(e))
        stop_ray_node(proc)
        proc = None
        _linger_for_done(rdv, linger_s)
        raise
    finally:
        stop_ray_node(proc)


def _linger_for_done(rdv: Path, linger_s: float, after_done_s: float = 10.0) -> None:
    """Let node 0 notice and record our failure before we exit non-zero (srun then ends every task).

    Node 0 writes `done` before it records the failure in job.json and exits; when it exits with an
    error first, srun's --kill-on-bad-exit ends this task during the wait, which is the intent.
    """
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline and not (rdv / "done").exists():
        time.sleep(POLL_S)
    if (rdv / "done").exists():
        time.sleep(after_done_s)


def _wait_for_head_file(rdv: Path, deadline: float, alloc: SlurmAllocation) -> dict | None:
    while time.monotonic() < deadline:
        head = read_status(rdv / "head.json")
        if head:
            return head
        if (rdv / "done").exists():  # node 0 gave up before its head came up
            return None
        time.sleep(POLL_S)
    raise RayBringUpError(f"node {alloc.nodename}: no Ray head of job {alloc.job_id} appeared in {rdv}")


def _block_until_done(rdv: Path, proc: subprocess.Popen, address: str, log_path: Path, head_lost_s: float) -> None:
    host, port = address.rsplit(":", 1)
    last_seen = time.monotonic()
    checked = 0.0
    while not (rdv / "done").exists():
        if proc.poll() is not None:
            raise RayBringUpError(f"ray on this node exited with code {proc.returncode}: {_tail(log_path)}")
        now = time.monotonic()
        if now - checked >= 5.0:
            checked = now
            if reachable(host, int(port)):
                last_seen = now
            elif now - last_seen > head_lost_s:
                raise RayNodeLost(
                    f"the Ray head {address} stopped answering {head_lost_s:.0f}s ago without saying done"
                )
        time.sleep(POLL_S)


# ---------------------------------------------------------------- every node, one call


def run_on_allocation(
    payload: Callable[[RayAllocationInfo], T],
    rendezvous_root: Path,
    *,
    deadline_s: float = 180.0,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> T | None:
    """Run `payload(info)` on node 0 with Ray up on every node of the job; other nodes serve and get None."""
    alloc = SlurmAllocation.from_env()
    if alloc is None:
        raise RayBringUpError("not inside a SLURM task (no SLURM_JOB_ID / SLURM_NODEID)")
    if alloc.node_rank != 0:
        serve_worker(alloc, rendezvous_root, deadline_s=deadline_s, num_cpus=num_cpus, num_gpus=num_gpus)
        return None
    with ray_head(alloc, rendezvous_root, deadline_s=deadline_s, num_cpus=num_cpus, num_gpus=num_gpus) as info:
        return payload(info)


def probe_nodes(info: RayAllocationInfo) -> dict:
    """A trivial payload: the alive Ray nodes and, per SLURM node, where a pinned task really ran."""
    import ray

    @ray.remote(num_cpus=0)
    def where() -> dict:
        return {"slurm_node": os.environ.get("SLURMD_NODENAME"), "ip": ray.util.get_node_ip_address()}

    alive = [n for n in ray.nodes() if n.get("Alive")]
    refs = {n: where.options(resources={node_resource(n): 0.001}).remote() for n in info.nodes}
    return {
        "alive_nodes": len(alive),
        "addresses": sorted(n["NodeManagerAddress"] for n in alive),
        "ran_on": {n: ray.get(r, timeout=120) for n, r in refs.items()},
        "ready_s": round(info.ready_s, 2),
        "address": info.address,
    }
