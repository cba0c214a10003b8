"""The reliability promises on the real local SLURM cluster, through the CLI: the classes that concern SLURM.

Needs a cluster (tools/slurm/up-2node.sh; the GRPO test needs its 2 nodes with network namespaces).
Skipped when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
GRPO = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


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
def data(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("slurm-chaos-data") / "clevr"
    return [
        *("--set", f"data.path={path}", "--set", "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}"),
        *("--set", "train.val_samples=0", "--set", "logger.wandb_mode=disabled", "--set", "cluster.time_limit=10"),
    ]


def vlmrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )


def in_queue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip())


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def job(run: Path) -> dict:
    return json.loads((run / "job.json").read_text())


def submit(run: Path, data: list[str], *sets: str, recipe: str = TINY) -> str:
    out = vlmrun("submit", recipe, "--cluster", "slurm", "--run-dir", str(run), *data, *sets, "--json")
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


def test_two_resumes_at_once_train_one_attempt_and_refuse_the_other(cluster, data, tmp_path):
    run = tmp_path / "run"
    out = vlmrun(
        "submit", TINY, "--cluster", "slurm", "--run-dir", str(run), *data, "--set", "train.max_steps=4", "--wait"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cmd = [sys.executable, "-m", "vlmrun.cli", "resume", str(run), "--set", "train.max_steps=12", "--wait"]
    both = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in both]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "Traceback" not in refused and ("pid" in refused or "still in the queue" in refused), refused
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r["step"] for r in rows if r["step"] > 4]
    assert sorted(trained) == list(range(5, 13))  # each step once: one attempt trained


def test_sigkill_of_node_0_takes_every_process_of_the_attempt_with_it(cluster, data, tmp_path):
    import psutil

    run = tmp_path / "run"
    job_id = submit(run, data, "--set", "train.max_steps=200", "--set", "train.epochs=20")
    wait_until(lambda: (run / "metrics.jsonl").exists() and history(run / "metrics.jsonl"), 240, "a first step")
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

    def ours() -> list[int]:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get("VLMRUN_ATTEMPT_MARKER") == marker:
                    found.append(p.pid)
            except psutil.Error:
                continue
        return found

    wait_until(lambda: not ours(), 10, "every process of the attempt to be gone")
    steps = max(history(run / "metrics.jsonl"))
    wait_until(lambda: not in_queue(job_id), 120, "the job to leave the queue")
    assert max(history(run / "metrics.jsonl")) == steps  # nothing written after the kill
    status = json.loads(vlmrun("status", str(run), "--json").stdout)
    assert status["state"] in ("KILLED", "FAILED") and job(run)["attempts"][-1]["state"] == "KILLED", status


def test_grpo_on_two_nodes_with_mooncake_matches_one_machine(cluster, data, tmp_path):
    if len(cluster) < 2:
        pytest.skip("needs 2 nodes: tools/slurm/up-2node.sh")
    common = ("--set", "train.max_steps=3", "--set", "checkpoint.save_period=0", "--set", "train.val_samples=0")
    local = tmp_path / "local"
    out = vlmrun("submit", GRPO, "--cluster", "local", "--run-dir", str(local), *data, *common, "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    two = tmp_path / "two"
    out = vlmrun(
        "submit",
        GRPO,
        "--cluster",
        "slurm",
        "--run-dir",
        str(two),
        *data,
        *common,
        *("--set", "cluster.nodes=2", "--set", "cluster.cpus_per_node=1"),
        *("--set", "data_plane.impl=transfer_queue", "--set", "data_plane.backend=mooncake"),
        "--wait",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    attempt = job(two)["attempts"][-1]
    assert attempt["ray_alive_nodes"] == 2 and len(set(attempt["worker_nodes"])) == 2
    a, b = history(local / "metrics.jsonl"), history(two / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        for key in ("loss", "grad_norm", "reward", "probs_ratio_min", "probs_ratio_max", "sample_ids"):
            assert a[s][key] == b[s][key], (s, key)
