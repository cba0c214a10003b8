"""`vlmrun submit --cluster slurm`: check, render and submit a run with submitit; optionally wait for it.

1. Before anything is submitted: the values are safe for the script (slurm_render.check_shell_safety),
   `sbatch`/`srun`/`scontrol`/`squeue` exist, the recipe fits the partition where `sinfo` can tell
   (nodes, CPUs, GPUs, memory, time), multi-node runs have a run dir the nodes can see and nodes with
   addresses of their own. A misfit is an InputError naming the field (exit 2); nothing is submitted.
2. `--dry-run` returns the exact sbatch script (SubmitResult.rendered), creates and submits nothing.
3. The submitted function is `NodeEntrypoint(run_dir)` (slurm_entry.py): every node runs the node
   entrypoint in-process; node 0 decides about requeues after the driver stopped.
4. The job is submitted held (`sbatch --hold`), recorded in job.json (`add_job`) and in the job
   registry (jobs.register_job), then released: the job never races the submitter on job.json.
   `wait` polls squeue and job.json until the job has left the queue (requeues included).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from vlmrun.errors import InputError
from vlmrun.launch import job_record, jobs, requeue
from vlmrun.launch.rundir import RunDirectory
from vlmrun.launch.slurm_render import check_shell_safety, make_executor, render_script

log = logging.getLogger(__name__)
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")
_EXIT = {"COMPLETED": job_record.EXIT_COMPLETED, "STOPPED": job_record.EXIT_STOPPED,
         "BUDGET_EXHAUSTED": job_record.EXIT_STOPPED}


def submit_slurm(rd: RunDirectory, recipe, *, dry_run: bool, wait: bool, echo: Callable[[str], None] | None = None,
                 entrypoint: Callable[[], int] | None = None, poll_s: float = 2.0):
    """Submit `recipe` as a SLURM job writing into `rd` (created here when it does not exist yet).

    `entrypoint` replaces NodeEntrypoint(rd.path) (tests submit trivial payloads). Raises InputError
    before submitting anything when the run cannot work on this cluster.
    """
    from vlmrun.launch.slurm_entry import NodeEntrypoint
    from vlmrun.launch.submit import SubmitResult

    say = echo or (lambda _msg: None)
    check_shell_safety(recipe, rd.path)
    for warning in requeue.signal_delay_warnings(recipe):
        log.warning("%s", warning)
        say(f"warning: {warning}")
    if dry_run:
        return SubmitResult(rd.path, "slurm", True, rendered=render_script(rd.path, recipe))
    for warning in preflight(rd.path, recipe):
        log.warning("%s", warning)
        say(f"warning: {warning}")
    if not rd.exists():
        rd.create(recipe)
    executor = make_executor(rd.path, recipe)
    job = executor.submit(entrypoint or NodeEntrypoint(str(rd.path)))  # held until recorded
    try:
        job_record.add_job(rd, job.job_id, "slurm", recipe.name)
        jobs.register_job(job.job_id, rd.path)
        subprocess.run(["scontrol", "release", job.job_id], check=True, capture_output=True, text=True, timeout=60)
    except BaseException:
        jobs.run_tool(["scancel", job.job_id])
        raise
    say(f"submitted job {job.job_id}; run dir {rd.path}\nfollow it with: vlmrun logs {job.job_id} -f")
    if not wait:
        return SubmitResult(rd.path, "slurm", False, job_id=job.job_id, state="PENDING")
    return wait_for_job(rd, job.job_id, echo=echo, poll_s=poll_s)


def resume_slurm(rd: RunDirectory, recipe, *, wait: bool, echo: Callable[[str], None] | None = None):
    """A new SLURM job that continues the ended run in `rd` (its job id joins the run's lineage).

    Raises InputError while the run's last job is still in the queue.
    """
    last = (rd.read_job().get("job_ids") or [None])[-1]
    if last and not str(last).startswith("local-") and jobs.is_live(str(last)):
        raise InputError("RUN_DIR", str(rd.path), message=f"job {last} of {rd.path} is still in the queue; "
                         f"wait for it or `vlmrun cancel {last}` before resuming")
    return submit_slurm(rd, recipe, dry_run=False, wait=wait, echo=echo)


def wait_for_job(rd: RunDirectory, job_id: str, *, echo: Callable[[str], None] | None = None, poll_s: float = 2.0):
    """Block until `job_id` has left the queue (through its requeues); the result carries job.json's outcome."""
    from vlmrun.launch.submit import SubmitResult

    say = echo or (lambda _msg: None)
    seen, shown_step = None, None
    try:
        while True:
            queued = _queue_state(job_id)
            job = rd.read_job()
            now = (queued, job.get("state"), len(job.get("attempts", [])))
            if now != seen:
                say(f"job {job_id}: {queued or 'left the queue'} (run: {job.get('state')}, attempts {now[2]})")
                seen = now
            step = jobs.last_metrics(rd)["last_step"]
            if step is not None and step != shown_step:
                shown_step = step
                say(f"job {job_id}: step {step}")
            if queued is None:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        say(f"detached; job {job_id} keeps running: vlmrun status {job_id}")
        return SubmitResult(rd.path, "slurm", False, job_id=job_id, state=seen[0] if seen else None, exit_code=130)
    job = rd.read_job()
    state = job.get("state")
    if state not in job_record.ENDED:
        slurm = jobs.slurm_state(job_id) or {}
        state = "FAILED"
        say(f"job {job_id} ended ({slurm.get('state', 'state unknown')}) without recording an outcome; "
            f"see {jobs.log_file(rd, job_id)}")
    return SubmitResult(rd.path, "slurm", False, job_id=job_id, state=state, exit_code=_EXIT.get(state, 1))


def _queue_state(job_id: str) -> str | None:
    """squeue's state of `job_id`; None once it left the queue; 'UNKNOWN' while squeue cannot answer."""
    rc, out, err = jobs.run_tool(["squeue", "-h", "-j", job_id, "-o", jobs.SQUEUE_FORMAT])
    if rc != 0:
        return None if "Invalid job id" in err else "UNKNOWN"
    return (jobs.parse_squeue(out).get(job_id) or {}).get("state")


# ---------------------------------------------------------------- checks before submitting

def preflight(run_dir: Path, recipe) -> list[str]:
    """Raise InputError when the run cannot work on this cluster; return warnings for what may not."""
    c = recipe.cluster
    for tool in ("sbatch", "srun", "scontrol", "squeue"):
        if not shutil.which(tool):
            raise InputError("--cluster", "slurm",
                             f"`{tool}` is not on PATH: run on a SLURM login node or use --cluster local")
    nodes = partition_nodes(c.partition)
    if nodes is None:
        return ["sinfo did not answer: the recipe was not checked against the partition"]
    check_fits(recipe, nodes)
    return check_nodes_see_run_dir(run_dir, c.nodes, nodes)


def partition_nodes(partition: str | None) -> list[dict] | None:
    """The nodes of `partition` (default: the default partition) from sinfo + scontrol; None if sinfo fails."""
    rc, out, _ = jobs.run_tool(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%l"])
    if rc != 0:
        return None
    rows = parse_sinfo(out)
    names = sorted({r["partition"] for r in rows})
    chosen = partition or next((r["partition"] for r in rows if r["default"]), None)
    if chosen not in names:
        raise InputError("cluster.partition", partition, f"partitions here: {', '.join(names) or 'none'}"
                         if partition else "no default partition here: set cluster.partition")
    picked = [r for r in rows if r["partition"] == chosen]
    rc, out, _ = jobs.run_tool(["scontrol", "show", "node", "-o"])
    parsed = (jobs.parse_scontrol_job(line) for line in out.splitlines()) if rc == 0 else ()
    details = {d.get("NodeName"): d for d in parsed}
    for r in picked:
        d = details.get(r["node"], {})
        r["addr"], r["host"] = d.get("NodeAddr"), d.get("NodeHostName")
    return picked


def parse_sinfo(text: str) -> list[dict]:
    """`sinfo -h -N -o '%N|%P|%c|%m|%G|%l'` -> one dict per (node, partition)."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6:
            continue
        node, part, cpus, mem, gres, limit = parts
        rows.append({"node": node, "partition": part.rstrip("*"), "default": part.endswith("*"),
                     "cpus": int(cpus.rstrip("+") or 0), "mem_mb": int(re.sub(r"\D", "", mem) or 0),
                     "gpus": gres_gpus(gres), "max_minutes": parse_limit(limit)})
    return rows


def gres_gpus(gres: str) -> int:
    """GPUs in a sinfo %G string: 'gpu:8', 'gpu:a100:4(S:0-1),gpu:v100:2' -> 8, 6; '(null)' -> 0."""
    return sum(int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def parse_limit(text: str) -> int | None:
    """sinfo %l ('infinite', '1-00:00:00', '4:00:00', '30:00') -> minutes; None when unlimited."""
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, _, rest = text.rpartition("-")
    nums = [int(x) for x in rest.split(":")]
    h, m, s = ([0] * (3 - len(nums)) + nums) if len(nums) < 3 else nums
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def check_fits(recipe, nodes: list[dict]) -> None:
    c = recipe.cluster
    part = nodes[0]["partition"] if nodes else c.partition
    if len(nodes) < c.nodes:
        raise InputError("cluster.nodes", c.nodes, f"partition {part} has {len(nodes)} node(s)")
    for field, want, key, unit in [("cluster.cpus_per_node", c.cpus_per_node, "cpus", "CPUs"),
                                   ("cluster.gpus_per_node", c.gpus_per_node, "gpus", "GPUs"),
                                   ("cluster.mem_gb", (c.mem_gb or 0) * 1024, "mem_mb", "MB of memory")]:
        fitting = [n for n in nodes if n[key] >= want]
        if len(fitting) < c.nodes:
            best = max(n[key] for n in nodes)
            shown = c.mem_gb if key == "mem_mb" else want
            raise InputError(field, shown, f"{c.nodes} node(s) of partition {part} must have {want} {unit} each; "
                             f"{len(fitting)} have, the largest has {best}")
    limits = [n["max_minutes"] for n in nodes if n["max_minutes"] is not None]
    if limits and c.time_limit > max(limits):
        raise InputError("cluster.time_limit", c.time_limit, f"partition {part} allows at most {max(limits)} minutes")


def check_nodes_see_run_dir(run_dir: Path, n_nodes: int, nodes: list[dict]) -> list[str]:
    """Multi-node runs: distinct node addresses (Ray) and a run dir every node can see."""
    if n_nodes <= 1:
        return []
    addrs = [n.get("addr") for n in nodes if n.get("addr")]
    if addrs and len(set(addrs)) < min(n_nodes, len(addrs)):
        raise InputError("cluster.nodes", n_nodes, f"the nodes share address(es) {sorted(set(addrs))}: Ray across "
                         "nodes needs one address per node (local cluster: SLURM_NETNS=1 tools/slurm/up-2node.sh)")
    if not any(str(run_dir) == p or str(run_dir).startswith(p + "/") for p in NODE_LOCAL):
        return []
    here = _short_hostname()
    if nodes and all((n.get("host") or "").split(".")[0] == here for n in nodes):
        return [f"run dir {run_dir} is node-local storage; it works here only because every node of this "
                "cluster runs on this machine. On a real cluster use a shared filesystem."]
    raise InputError("--run-dir", str(run_dir), f"with cluster.nodes={n_nodes} the run dir must be on a filesystem "
                     "every node sees (not /tmp, /var/tmp, /dev/shm)")


def _short_hostname() -> str:
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
