"""The tiny SFT recipe on the real local SLURM cluster, through the CLI a user types: every SLURM run
here has the arguments of the session's local `sft_baseline` and must equal it at every step.

The chain (one run directory, a test per step, in order): `vlmrun requeue` at a random step restarts the
job (same job id, restart count 1); SIGKILL of node 0 takes every process of the attempt with it and
nothing more is written; of two resumes at once one trains and the other is refused; the run then ends
COMPLETED with the numbers of the uninterrupted local run, and `status` and `logs` say so. Besides, a
2-node run (one rank per node) gives the same numbers.

Needs a cluster: tools/slurm/up.sh (1 node) or tools/slurm/up-2node.sh (the 2-node test). Skipped
when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
from shared_runs import SFT_STEPS
from vlmrun_cli import ENV, ROOT, TINY, job, last_step, rows, same_history, sealed, sets, vlmrun, wait_for

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ON_SLURM = sets("cluster.time_limit=10")


def nodes() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %o"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.split("\n") if line.strip()] if out.returncode == 0 else []


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    found = nodes()
    if not found:
        pytest.skip("no SLURM cluster answers `sinfo`; start one with tools/slurm/up.sh")
    return found


def in_queue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip())


def attempt_processes(marker: str) -> list[int]:
    """Every live process whose environment carries the attempt's marker (SLURM starts the node with it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("VLMRUN_ATTEMPT_MARKER") == marker:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def chain(cluster, sft_sets, sft_baseline, tmp_path_factory) -> dict:
    return {"run": tmp_path_factory.mktemp("slurm-chain") / "run", "args": [*sft_sets, *ON_SLURM]}


def test_1_requeue_at_a_random_step_restarts_the_job_with_the_same_id(chain):
    run = chain["run"]
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), *chain["args"], "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    job_id = chain["job_id"] = json.loads(out.stdout)["job_id"]
    at = random.randint(2, 5)
    wait_for(lambda: last_step(run) >= at, 300, f"step {at}")
    assert vlmrun("requeue", job_id).returncode == 0
    wait_for(lambda: len(job(run)["attempts"]) == 2 and job(run)["attempts"][1]["state"] == "RUNNING", 300, "restart")
    record = job(run)
    assert record["job_ids"] == [job_id] and [a["restart_count"] for a in record["attempts"]] == [0, 1]
    assert record["attempts"][0]["state"] == "STOPPED" and record["attempts"][0]["requeue_cause"] == "requested"


def test_2_sigkill_of_node_0_takes_every_process_of_the_attempt_with_it(chain):
    import psutil

    run, job_id = chain["run"], chain["job_id"]
    target = last_step(run) + 3
    wait_for(lambda: any(s >= target for s in sealed(run)), 300, f"a checkpoint at step {target}")
    pid = job(run)["attempts"][-1]["pid"]
    # the node sets the marker in its environment once it runs (/proc shows the one it started with):
    # its reaper is told the marker on its command line
    reaper = next(
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if "vlmrun.cluster.reaper" in (p.info["cmdline"] or []) and str(pid) in (p.info["cmdline"] or [])
    )
    marker = reaper[reaper.index("--marker") + 1]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not attempt_processes(marker), 10, "every process of the attempt to be gone", poll=0.2)
    steps = last_step(run)
    wait_for(lambda: not in_queue(job_id), 120, "the job to leave the queue", poll=0.5)
    assert last_step(run) == steps  # nothing written after the kill
    status = json.loads(vlmrun("status", str(run), "--json").stdout)
    assert status["state"] in ("KILLED", "FAILED"), status
    # The node's reaper records the attempt KILLED once it has swept; the job may leave the queue before it
    # has written (its imports take a while on busy CPUs), so the record is awaited, not read at once.
    wait_for(lambda: job(run)["attempts"][-1]["state"] == "KILLED", 60, "the reaper to record the attempt KILLED")
    assert last_step(run) == steps


def test_3_of_two_resumes_at_once_one_trains_and_the_run_ends_as_the_uninterrupted_one(chain, sft_baseline):
    run = chain["run"]
    cmd = [sys.executable, "-m", "vlmrun.cli", "resume", str(run), "--wait"]
    both = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in both]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "Traceback" not in refused and ("pid" in refused or "still in the queue" in refused), refused
    record = job(run)
    assert [a["state"] for a in record["attempts"]] == ["STOPPED", "KILLED", "COMPLETED"]  # the refused one: none
    assert record["attempts"][-1]["ray_alive_nodes"] == 1  # Ray on the allocation's one node
    start = record["attempts"][-1]["resumed_from"]
    trained = [r["step"] for r in rows(run) if r["attempt"] == 2]
    assert trained == list(range(start + 1, SFT_STEPS + 1))  # each step once: one attempt trained
    same_history(run, sft_baseline)


def test_4_status_and_logs_say_how_the_run_ended(chain):
    run = chain["run"]
    job_id = job(run)["job_ids"][-1]
    st = vlmrun("status", job_id, "--json")
    assert st.returncode == 0, st.stderr
    d = json.loads(st.stdout)
    assert d["state"] == "COMPLETED" and d["last_step"] == SFT_STEPS and d["run_dir"] == str(run)
    start = job(run)["attempts"][-1]["resumed_from"]
    logs = vlmrun("logs", job_id)
    said = f"COMPLETED: finished at step {SFT_STEPS} of {SFT_STEPS}; {SFT_STEPS - start} step(s) in this attempt"
    assert logs.returncode == 0 and said in logs.stdout, logs.stdout[-3000:]


def test_two_nodes_one_worker_each_same_numbers_as_one_machine(cluster, sft_sets, sft_baseline, tmp_path):
    if len(cluster) < 2:
        pytest.skip("needs 2 nodes: tools/slurm/up-2node.sh")
    run = tmp_path / "two"
    two = sets("cluster.nodes=2", "cluster.cpus_per_node=1")
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), *sft_sets, *ON_SLURM, *two, "--wait")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    attempt = job(run)["attempts"][-1]
    assert attempt["ray_alive_nodes"] == 2
    assert len(set(attempt["worker_nodes"])) == 2  # one rank per node
    same_history(run, sft_baseline)
    assert (
        history(run / "metrics.jsonl")[SFT_STEPS]["val_loss"]
        == history(sft_baseline / "metrics.jsonl")[SFT_STEPS]["val_loss"]
    )
