"""The reliability promises on the real local SLURM cluster, through the CLI: the classes that concern SLURM.

Cancel right after submit says the state the job ended in; a stop signal at start-up ends it STOPPED
without training; GRPO on two nodes through Mooncake gives the numbers of the session's local
`grpo_want`. (Requeue, SIGKILL of node 0 and two resumes at once, on one SFT run: test_slurm_sft.py.)

Needs a cluster (tools/slurm/up-2node.sh; the GRPO test needs its 2 nodes with network namespaces).
Skipped when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from shared_runs import GRPO_STEPS
from vlmrun_cli import GRPO, TINY, job, sets, vlmrun

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]


def sinfo_nodes() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(set(out.stdout.split())) if out.returncode == 0 else []


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    found = sinfo_nodes()
    if not found:
        pytest.skip("no SLURM cluster answers `sinfo`; start one with tools/slurm/up-2node.sh")
    return found


@pytest.fixture(scope="module")
def data(run_data) -> list[str]:
    return [*run_data, *sets("train.val_samples=0", "cluster.time_limit=10")]


def in_queue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip())


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def submit(run: Path, data: list[str], *more: str, recipe: str = TINY) -> str:
    out = vlmrun("submit", recipe, "--cluster", "slurm", "--run-dir", str(run), *data, *more, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["job_id"]


def test_cancel_right_after_submit_prints_the_state_the_job_ended_in(cluster, data, tmp_path):
    run = tmp_path / "run"
    job_id = submit(run, data, "--set", "train.max_steps=200", "--set", "train.epochs=20")
    out = vlmrun("cancel", job_id, "--json", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    said = json.loads(out.stdout)
    printed = said["state"]
    assert not in_queue(job_id)
    assert printed == job(run)["state"] and printed in ("CANCELLED", "STOPPED", "KILLED"), (printed, job(run))
    if printed == "KILLED":  # SLURM ended it before it checkpointed: said as what cancel did, not as a lost node
        assert "`vlmrun cancel`" in said["reason"] and "out of memory" not in said["reason"], said
    steps = history(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else {}
    time.sleep(3)  # nothing goes on writing after cancel returned
    after = history(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else {}
    assert after == steps and (not steps or max(steps) < 200)


@pytest.mark.parametrize("signame", ["TERM", "INT"])
def test_a_stop_signal_at_start_up_ends_stopped_without_training(cluster, data, tmp_path, signame):
    run = tmp_path / "run"
    job_id = submit(run, data, "--set", "train.max_steps=50")
    wait_until(lambda: (run / "job.json").exists() and job(run)["attempts"], 120, "the attempt to begin")
    subprocess.run(["scancel", f"--signal={signame}", job_id], check=True)  # every process of the job's steps
    wait_until(lambda: not in_queue(job_id), 240, "the job to end")
    record = job(run)
    assert record["attempts"][-1]["state"] == "STOPPED", record
    assert record["attempts"][-1].get("stop_signal") == f"SIG{signame}"
    assert len(record["attempts"]) == 1  # only SIGUSR2 requeues
    assert not (run / "metrics.jsonl").exists() or not history(run / "metrics.jsonl")


def test_grpo_on_two_nodes_with_mooncake_matches_one_machine(cluster, grpo_sets, grpo_want, tmp_path):
    if len(cluster) < 2:
        pytest.skip("needs 2 nodes: tools/slurm/up-2node.sh")
    two = tmp_path / "two"
    spread = sets("cluster.nodes=2", "cluster.cpus_per_node=1", "cluster.time_limit=10")
    mooncake = sets("data_plane.impl=transfer_queue", "data_plane.backend=mooncake")
    out = vlmrun("submit", GRPO, "--cluster", "slurm", "--run-dir", str(two), *grpo_sets, *spread, *mooncake, "--wait")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    attempt = job(two)["attempts"][-1]
    assert attempt["ray_alive_nodes"] == 2 and len(set(attempt["worker_nodes"])) == 2
    a, b = history(grpo_want / "metrics.jsonl"), history(two / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, GRPO_STEPS + 1))
    for s in a:
        for key in ("loss", "grad_norm", "reward", "probs_ratio_min", "probs_ratio_max", "sample_ids", "val_accuracy"):
            assert a[s].get(key) == b[s].get(key), (s, key)
