"""Sync GRPO end to end on the tiny recipe: real Ray, real Energon, the real tiny Qwen2.5-VL, via the CLI.

The policy starts from a short SFT run exported with `vlmrun export` (a random model earns almost no
reward). What users depend on: every data-plane setting (local, TransferQueue simple and Mooncake, and
no plane) gives the same numbers at every step; with one inner step the ratio is exactly 1; a SIGKILLed
run resumed with `vlmrun resume` matches an uninterrupted one; the plane is empty at step boundaries.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
SFT = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
SAME = (
    *("loss", "grad_norm", "lr", "valid_tokens", "sample_ids", "reward", "advantage_mean"),
    *("token_mult_prob_error", "probs_ratio_min", "probs_ratio_max"),
)
#: Keys every GRPO row carries: the run contract's and GRPO's own (metrics.py)
ROW_KEYS = """step attempt consumed_samples step_time_s loader_latency_max_s peak_rss_mb accuracy
kl gen_kl_error sampling_importance_ratio advantage_min advantage_max response_length_mean time_generation_s
time_refit_s time_logprob_s time_advantage_s time_train_s time_data_plane_s plane_bytes val_accuracy""".split()
PLANES = {
    "local": ["data_plane.impl=local"],
    "tq_simple": ["data_plane.impl=transfer_queue", "data_plane.backend=simple"],
    "tq_mooncake": ["data_plane.impl=transfer_queue", "data_plane.backend=mooncake"],
    "driver": ["data_plane.enabled=false"],
}


def vlmrun(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600
    )


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """A small data set and the policy: 40 SFT steps on it, exported."""
    work = tmp_path_factory.mktemp("grpo")
    data = [f"data.path={work / 'clevr'}", "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}"]
    quiet = ["logger.wandb_mode=disabled", "train.val_samples=8"]
    sft = vlmrun(
        "submit",
        SFT,
        "--cluster",
        "local",
        "--run-dir",
        str(work / "sft"),
        *sets(*data, *quiet, "train.max_steps=40"),
        "--wait",
    )
    assert sft.returncode == 0, sft.stderr[-3000:]
    out = vlmrun("export", str(work / "sft"), str(work / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.val_period=3"]  # a step in ~0.3 s
    return sets(*data, *quiet, *small, "model.tiny=false", f"model.path={work / 'model'}")


def grpo(run: Path, base: list[str], *items: str) -> dict[int, dict]:
    out = vlmrun("submit", GRPO, "--cluster", "local", "--run-dir", str(run), *base, *sets(*items), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return history(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, base) -> dict[int, dict]:
    return grpo(tmp_path_factory.mktemp("runs") / "local", base, "train.max_steps=3", *PLANES["local"])


def test_one_inner_step_keeps_the_ratio_at_one_and_rows_carry_the_contract(local_run):
    assert sorted(local_run) == [1, 2, 3]
    for row in local_run.values():
        assert row["probs_ratio_min"] == 1.0 == row["probs_ratio_max"]
        assert len(row["sample_ids"]) == 8 and row["valid_tokens"] > 0 and row["grad_norm"] > 0
    assert statistics.median(r["token_mult_prob_error"] for r in local_run.values()) < 1.05
    row = local_run[3]
    for key in ROW_KEYS:
        assert key in row, key
    assert any(k.startswith("accuracy/") for k in row) and row["consumed_samples"] == 24


@pytest.mark.parametrize("plane", ["tq_simple", "tq_mooncake", "driver"])
def test_every_data_plane_setting_gives_the_same_numbers(tmp_path, base, local_run, plane):
    if plane == "tq_mooncake":
        from vlmrun.cluster.mooncake import mooncake_unavailable

        if mooncake_unavailable():
            pytest.skip(mooncake_unavailable())
    other = grpo(tmp_path / plane, base, "train.max_steps=3", *PLANES[plane])
    for step, row in local_run.items():
        for key in SAME:
            assert other[step][key] == row[key], (plane, step, key)
    assert (other[1]["plane_bytes"] == 0) == (plane == "driver")


def test_two_inner_steps_move_the_ratio_off_one_and_the_kl_penalty_sees_it(tmp_path, base):
    rows = grpo(tmp_path / "inner", base, "train.max_steps=2", "grpo.inner_steps=2", "grpo.kl_coef=0.05")
    assert all(r["probs_ratio_min"] < 1.0 < r["probs_ratio_max"] for r in rows.values())
    assert all(r["kl"] > 0 for r in rows.values())  # the reference logprobs went through the plane


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, base):
    steps = ["train.max_steps=6", "checkpoint.save_period=2"]
    want = grpo(tmp_path / "a", base, *steps)
    run = tmp_path / "b"
    cmd = [sys.executable, "-m", "vlmrun.cli", "submit", GRPO, "--cluster", "local", "--run-dir", str(run)]
    proc = subprocess.Popen(
        [*cmd, *base, *sets(*steps), "--wait"],
        env=ENV,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while max(history(run / "metrics.jsonl") or [0]) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    got = history(run / "metrics.jsonl")
    assert sorted(got) == sorted(want)
    for step in want:
        for key in (*SAME, "probs_ratio_max", "accuracy"):
            assert got[step][key] == want[step][key], (step, key)
    job = json.loads((run / "job.json").read_text())
    assert [a["state"] for a in job["attempts"]] == ["KILLED", "COMPLETED"]
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert {p.name for p in (checkpoint / "generation").iterdir()} == {"replica_0.pt", "replica_1.pt"}
