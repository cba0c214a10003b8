"""Checks before a SLURM submit: the partition can hold the recipe, and its time-limit signal is usable.

`preflight` raises InputError (naming the field) when the run cannot work on this cluster: missing
SLURM tools, a partition without the nodes, CPUs, GPUs, memory or time the recipe asks for, nodes
that share an address or cannot see the run dir. `signal_delay_warnings` says when
`signal_delay_s` looks too short for one step plus a checkpoint (the assumptions are in the message).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.launch.slurm.queries import controller_unreachable, parse_ping, parse_scontrol_job, parse_sinfo, run_tool

NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")
CONTROLLER_HINT = "start slurmctld (or point SLURM_CONF at the cluster's), or run on this machine with --cluster local"


def preflight(run_dir: Path, recipe) -> list[str]:
    """Raise InputError when the run cannot work on this cluster; return warnings for what may not."""
    c = recipe.cluster
    for tool in ("sbatch", "srun", "scontrol", "squeue"):
        if not shutil.which(tool):
            raise InputError(
                "--cluster", "slurm", f"`{tool}` is not on PATH: run on a SLURM login node or use --cluster local"
            )
    if (problem := controller_problem()) is not None:
        raise InputError(
            "--cluster",
            "slurm",
            message=f"--cluster slurm: the SLURM controller does not answer ({problem}); {CONTROLLER_HINT}",
        )
    nodes = partition_nodes(c.partition)
    if nodes is None:
        return ["sinfo did not answer: the recipe was not checked against the partition"]
    check_fits(recipe, nodes)
    return check_nodes_see_run_dir(run_dir, c.nodes, nodes)


def controller_problem() -> str | None:
    """None when the SLURM controller answers `scontrol ping`, else what scontrol said (one line).

    Fast either way when the controller's port refuses (sbatch, squeue and sinfo retry for ~10 s first)."""
    rc, out, err = run_tool(["scontrol", "ping"], timeout=30)
    return parse_ping(rc, out + err)


def partition_nodes(partition: str | None) -> list[dict] | None:
    """The nodes of `partition` (default: the default partition) from sinfo + scontrol; None if sinfo fails."""
    rc, out, err = run_tool(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%l"])
    if rc != 0 and controller_unreachable(err):
        raise InputError("--cluster", "slurm", message=f"--cluster slurm: {' '.join(err.split())}; {CONTROLLER_HINT}")
    if rc != 0:
        return None
    rows = parse_sinfo(out)
    names = sorted({r["partition"] for r in rows})
    chosen = partition or next((r["partition"] for r in rows if r["default"]), None)
    if chosen not in names:
        raise InputError(
            "cluster.partition",
            partition,
            f"partitions here: {', '.join(names) or 'none'}"
            if partition
            else "no default partition here: set cluster.partition",
        )
    picked = [r for r in rows if r["partition"] == chosen]
    rc, out, _ = run_tool(["scontrol", "show", "node", "-o"])
    parsed = (parse_scontrol_job(line) for line in out.splitlines()) if rc == 0 else ()
    details = {d.get("NodeName"): d for d in parsed}
    for r in picked:
        d = details.get(r["node"], {})
        r["addr"], r["host"] = d.get("NodeAddr"), d.get("NodeHostName")
    return picked


def check_fits(recipe, nodes: list[dict]) -> None:
    c = recipe.cluster
    part = nodes[0]["partition"] if nodes else c.partition
    if len(nodes) < c.nodes:
        raise InputError("cluster.nodes", c.nodes, f"partition {part} has {len(nodes)} node(s)")
    for field, want, key, unit in [
        ("cluster.cpus_per_node", c.cpus_per_node, "cpus", "CPUs"),
        ("cluster.gpus_per_node", c.gpus_per_node, "gpus", "GPUs"),
        ("cluster.mem_gb", (c.mem_gb or 0) * 1024, "mem_mb", "MB of memory"),
    ]:
        fitting = [n for n in nodes if n[key] >= want]
        if len(fitting) < c.nodes:
            best = max(n[key] for n in nodes)
            shown = c.mem_gb if key == "mem_mb" else want
            raise InputError(
                field,
                shown,
                f"{c.nodes} node(s) of partition {part} must have {want} {unit} each; "
                f"{len(fitting)} have, the largest has {best}",
            )
    limits = [n["max_minutes"] for n in nodes if n["max_minutes"] is not None]
    if limits and c.time_limit > max(limits):
        raise InputError("cluster.time_limit", c.time_limit, f"partition {part} allows at most {max(limits)} minutes")


def check_nodes_see_run_dir(run_dir: Path, n_nodes: int, nodes: list[dict]) -> list[str]:
    """Multi-node runs: distinct node addresses (Ray) and a run dir every node can see."""
    if n_nodes <= 1:
        return []
    addrs = [n.get("addr") for n in nodes if n.get("addr")]
    if addrs and len(set(addrs)) < min(n_nodes, len(addrs)):
        raise InputError(
            "cluster.nodes",
            n_nodes,
            f"the nodes share address(es) {sorted(set(addrs))}: Ray across "
            "nodes needs one address per node (local cluster: SLURM_NETNS=1 tools/slurm/up-2node.sh)",
        )
    if not any(str(run_dir) == p or str(run_dir).startswith(p + "/") for p in NODE_LOCAL):
        return []
    here = _short_hostname()
    if nodes and all((n.get("host") or "").split(".")[0] == here for n in nodes):
        return [
            f"run dir {run_dir} is node-local storage; it works here only because every node of this "
            "cluster runs on this machine. On a real cluster use a shared filesystem."
        ]
    raise InputError(
        "--run-dir",
        str(run_dir),
        f"with cluster.nodes={n_nodes} the run dir must be on a filesystem "
        "every node sees (not /tmp, /var/tmp, /dev/shm)",
    )


def _short_hostname() -> str:
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


_STEP_S = {"tiny": 10, "gpu": 60, "cpu": 30}  # assumed seconds per optimizer step


_BYTES_PER_PARAM = 16  # bf16 weights 2 + fp32 master 4 + two fp32 Adam moments 8, rounded up


_WRITE_BPS_PER_NODE = 1e9  # assumed checkpoint write speed per node (shared filesystem)


def signal_delay_warnings(recipe) -> list[str]:
    """Warnings when cluster.signal_delay_s looks too short for one step plus one checkpoint."""
    c = recipe.cluster
    out = []
    if c.signal_delay_s >= c.time_limit * 60:
        out.append(
            f"cluster.signal_delay_s={c.signal_delay_s} is not shorter than cluster.time_limit="
            f"{c.time_limit} min: USR2 arrives as soon as the job starts"
        )
    kind = "tiny" if recipe.model.tiny else ("gpu" if c.gpus_per_node else "cpu")
    step_s = _STEP_S[kind]
    params = estimate_params(recipe.model)
    ckpt_s = params * _BYTES_PER_PARAM / (_WRITE_BPS_PER_NODE * c.nodes) if params else 5.0
    need = math.ceil(step_s + ckpt_s)
    if c.signal_delay_s < need:
        size = f"{params / 1e9:g}B parameters x {_BYTES_PER_PARAM} bytes" if params else "a small checkpoint (5 s)"
        out.append(
            f"cluster.signal_delay_s={c.signal_delay_s} may not fit one step plus a checkpoint: assumed "
            f"{step_s} s per step ({kind}) and {size} written at {_WRITE_BPS_PER_NODE / 1e9:g} GB/s per node "
            f"over {c.nodes} node(s) = {need} s; raise it to at least {need}"
        )
    return out


def estimate_params(model) -> float | None:
    """Parameter count from the model directory's name (`...-3B-...`, `...-30B-A3B`); None when unknown."""
    if model.tiny or not model.path:
        return None
    sizes = re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)[Bb](?![A-Za-z])", Path(model.path).name)
    return max(float(s) for s in sizes) * 1e9 if sizes else None
