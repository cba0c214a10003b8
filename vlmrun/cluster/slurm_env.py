"""The SLURM task environment: which job, which node, which rank; read from the variables SLURM sets.

Properties only, no side effects, so tests set `os.environ` with `mock.patch.dict(..., clear=True)`
(the pattern of Lightning's SLURMEnvironment). `node_address` asks `scontrol` for the node's address.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vlmrun.errors import CheckFailed


class SlurmEnvError(CheckFailed):
    """The SLURM environment cannot say something we need (a node's address)."""


@dataclass(frozen=True)
class SlurmAllocation:
    """This task's place in the SLURM job, read from the environment SLURM gives each task."""

    job_id: str
    node_rank: int
    num_nodes: int
    nodename: str
    nodelist: str
    restart_count: int = 0
    cpus_on_node: int = 1
    gpus_on_node: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmAllocation | None:
        """None outside a SLURM task (no SLURM_JOB_ID or no SLURM_NODEID)."""
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
            return None
        job_id = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        nodename = env.get("SLURMD_NODENAME") or socket.gethostname()
        return cls(
            job_id=job_id,
            node_rank=int(env["SLURM_NODEID"]),
            num_nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
            nodename=nodename,
            nodelist=env.get("SLURM_JOB_NODELIST", nodename),
            restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
            cpus_on_node=int(env.get("SLURM_CPUS_ON_NODE") or 1),
            gpus_on_node=_visible_gpus(env),
        )

    def hostnames(self) -> list[str]:
        """Node names of the job, node 0 first (`scontrol show hostnames`)."""
        if self.num_nodes == 1:
            return [self.nodename]
        out = subprocess.run(
            ["scontrol", "show", "hostnames", self.nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return out.split()

    def rendezvous(self, root: Path) -> Path:
        return Path(root) / f"{self.job_id}.{self.restart_count}"


def _visible_gpus(env: Mapping[str, str]) -> int:
    devices = env.get("CUDA_VISIBLE_DEVICES")
    if devices is not None:
        return len([d for d in devices.split(",") if d.strip() and d.strip() != "-1"])
    return int(env.get("SLURM_GPUS_ON_NODE") or 0)


def node_address(nodename: str) -> str:
    """The node's own address: SLURM's NodeAddr (a name is resolved), else `hostname -I` of this node."""
    try:
        out = subprocess.run(["scontrol", "show", "node", nodename], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    m = re.search(r"\bNodeAddr=(\S+)", out)
    addr = m.group(1) if m else ""
    if addr and addr != "(null)":
        return addr if _is_ip(addr) else socket.gethostbyname(addr)
    first = (subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split() or [""])[0]
    if not first:
        raise SlurmEnvError(f"cannot tell the address of node {nodename}: no NodeAddr and `hostname -I` is empty")
    return first


def _is_ip(text: str) -> bool:
    try:
        socket.inet_aton(text)
        return True
    except OSError:
        return False
