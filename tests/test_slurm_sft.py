"""The tiny SFT recipe on the real local SLURM cluster, through the CLI a user types.

Needs a cluster: tools/slurm/up.sh (1 node) or tools/slurm/up-2node.sh (the 2-node test). Skipped
when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]  # + the module run fixture (<= 600 s)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def nodes() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %o"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split("\n") if out.returncode == 0 and out.stdout.strip() else []


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    found = [line for line in nodes() if line.strip()]
    if not found:
        pytest.skip("no SLURM cluster answers `sinfo`; start one with tools/slurm/up.sh")
    return found


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    data = tmp_path_factory.mktemp("slurm-data") / "clevr"
    return [
        "--set",
        f"data.path={data}",
        "--set",
        "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}",
        "--set",
        "train.max_steps=24",
        "--set",
        "checkpoint.save_period=2",
        "--set",
        "train.val_samples=0",
        "--set",
        "logger.wandb_mode=disabled",
        "--set",
        "cluster.time_limit=10",
    ]


def vlmrun(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )


@pytest.fixture(scope="module")
def one_node_run(cluster, sets, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("slurm-runs") / "a"
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), *sets, "--wait")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run


def test_submit_wait_completes_and_status_and_logs_say_so(one_node_run):
    job_id = json.loads((one_node_run / "job.json").read_text())["job_ids"][-1]
    st = vlmrun("status", job_id, "--json")
    assert st.returncode == 0, st.stderr
    d = json.loads(st.stdout)
    assert d["state"] == "COMPLETED" and d["last_step"] == 24 and d["run_dir"] == str(one_node_run)
    logs = vlmrun("logs", job_id)
    assert logs.returncode == 0 and "COMPLETED: finished at step 24 of 24; 24 step(s) in this attempt" in logs.stdout


def test_requeue_at_a_random_step_resumes_to_the_same_history(one_node_run, sets, tmp_path):
    run = tmp_path / "b"
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), *sets, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    job_id = json.loads(out.stdout)["job_id"]
    at = random.randint(2, 4)
    deadline = time.time() + 300
    while time.time() < deadline:
        h = history(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else {}
        if h and max(h) >= at:
            break
        time.sleep(0.05)
    assert vlmrun("requeue", job_id).returncode == 0
    while (
        time.time() < deadline
        and subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()
    ):
        time.sleep(1)
    job = json.loads((run / "job.json").read_text())
    assert job["state"] == "COMPLETED" and job["job_ids"] == [job_id]
    assert [a["restart_count"] for a in job["attempts"]] == [0, 1]
    ha, hb = history(one_node_run / "metrics.jsonl"), history(run / "metrics.jsonl")
    assert sorted(ha) == sorted(hb) == list(range(1, 25))
    for s in ha:
        assert (ha[s]["loss"], ha[s]["grad_norm"], ha[s]["sample_ids"]) == (
            hb[s]["loss"],
            hb[s]["grad_norm"],
            hb[s]["sample_ids"],
        ), s


def test_two_nodes_one_worker_each_same_losses_as_one_node(cluster, one_node_run, sets, tmp_path):
    if len(cluster) < 2:
        pytest.skip("needs 2 nodes: tools/slurm/up-2node.sh")
    run = tmp_path / "two"
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "slurm",
        "--run-dir",
        str(run),
        *sets,
        "--set",
        "cluster.nodes=2",
        "--set",
        "cluster.cpus_per_node=1",
        "--wait",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    attempt = json.loads((run / "job.json").read_text())["attempts"][-1]
    assert attempt["ray_alive_nodes"] == 2
    assert len(set(attempt["worker_nodes"])) == 2  # one rank per node
    ha, hb = history(one_node_run / "metrics.jsonl"), history(run / "metrics.jsonl")
    assert [ha[s]["loss"] for s in sorted(ha)] == [hb[s]["loss"] for s in sorted(hb)]
