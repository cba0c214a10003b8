"""The node watchdog: while the driver runs, a node that leaves Ray fails the job fast instead of hanging it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from vlmrun.cluster.ray.nodes import node_resource, stop_ray_node
from vlmrun.cluster.watchdog import FailFast
from vlmrun.errors import CheckFailed


class RayNodeLost(CheckFailed):
    """A node of the job left Ray while the driver ran; the job fails instead of hanging."""


def read_status(path: Path) -> dict | None:
    """A JSON status file (head.json, worker-<node>.json), or None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def registered_nodes(nodes: list[str]) -> dict[str, dict]:
    """Node name -> Ray node entry, for the alive Ray nodes that carry our per-node marker."""
    import ray

    by_marker = {node_resource(n): n for n in nodes}
    found = {}
    for entry in ray.nodes():
        if not entry.get("Alive"):
            continue
        for res in entry.get("Resources", {}):
            if res in by_marker:
                found[by_marker[res]] = entry
    return found


class NodeWatchdog(FailFast):
    """Fails the driver fast when a node leaves (cluster/watchdog.py): the body ends with RayNodeLost.

    If the main thread does not come back within `hard_exit_s` (blocked in a call without timeout),
    ends our Ray processes and exits the process with code 1.
    """

    def __init__(
        self, nodes: list[str], rdv: Path, head_proc: subprocess.Popen, period_s: float = 2.0, hard_exit_s: float = 60.0
    ):
        self.nodes, self.rdv, self.head_proc = nodes, rdv, head_proc
        super().__init__(
            self._check,
            RayNodeLost,
            period_s=period_s,
            hard_exit_s=hard_exit_s,
            on_hard_exit=lambda _problem: stop_ray_node(head_proc),
            name="vlmrun-ray-watchdog",
        )

    def _check(self) -> str | None:
        if self.head_proc.poll() is not None:
            return f"the Ray head on {self.nodes[0]} exited with code {self.head_proc.returncode}"
        for n in self.nodes[1:]:
            status = read_status(self.rdv / f"worker-{n}.json")
            if status and status.get("state") == "failed":
                return f"node {n} failed: {status.get('reason')}"
        try:
            found = registered_nodes(self.nodes)
        except Exception as e:  # noqa: BLE001 - any failure to ask means the GCS itself is gone
            return f"lost the Ray head's state service: {type(e).__name__}: {e}"
        gone = [n for n in self.nodes if n not in found]
        return f"node(s) {', '.join(gone)} left the Ray cluster" if gone else None
