"""SFT end to end on the embedded default: real Ray, real Energon, the real tiny Qwen2.5-VL, via the CLI.

These are the paths users depend on: v1 == v2 bitwise, kill (SIGKILL or SIGUSR2) + resume == an
uninterrupted run at every step, no sample lost or repeated, a changed layout refused on resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    data = tmp_path_factory.mktemp("data") / "clevr"
    return [
        "--set",
        f"data.path={data}",
        "--set",
        "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}",
        "--set",
        "train.max_steps=30",
        "--set",
        "checkpoint.save_period=3",
        "--set",
        "train.val_samples=8",
        "--set",
        "train.val_period=5",
        "--set",
        "logger.wandb_mode=disabled",
    ]


def vlmrun(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=600,
        **kw,
    )


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vlmrun.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        cwd=ROOT,
        start_new_session=True,
    )


def last_step(run: Path) -> int:
    h = history(run / "metrics.jsonl")
    return max(h) if h else -1


def epoch_ids(run: Path) -> dict[int, Counter]:
    """epoch -> how often each sample id was trained on in it (the shuffle buffer spans epoch ends)."""
    out: dict[int, Counter] = {}
    for row in history(run / "metrics.jsonl").values():
        out.setdefault(row["epoch"], Counter()).update(row["sample_ids"])
    return out


def same_history(a: Path, b: Path, keys=("loss", "grad_norm", "sample_ids", "lr", "valid_tokens")) -> None:
    ha, hb = history(a / "metrics.jsonl"), history(b / "metrics.jsonl")
    assert sorted(ha) == sorted(hb) and ha
    for s in ha:
        for k in keys:
            assert ha[s][k] == hb[s][k], (s, k, ha[s][k], hb[s][k])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, sets) -> Path:
    run = tmp_path_factory.mktemp("runs") / "a"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    job = json.loads((run / "job.json").read_text())
    assert job["state"] == "COMPLETED" and job["attempts"][-1]["last_step"] == 30
    return run


def test_uninterrupted_run_writes_the_contract(uninterrupted):
    h = history(uninterrupted / "metrics.jsonl")
    assert sorted(h) == list(range(1, 31))
    row = h[5]
    for key in (
        "step",
        "attempt",
        "loss",
        "grad_norm",
        "lr",
        "valid_tokens",
        "consumed_samples",
        "sample_ids",
        "step_time_s",
        "loader_latency_max_s",
        "tokens_per_s",
        "peak_rss_mb",
        "val_loss",
        "val_accuracy",
    ):
        assert key in row, key
    assert row["consumed_samples"] == 5 * 8 and len(row["sample_ids"]) == 8
    ckpts = sorted(p.name for p in (uninterrupted / "checkpoints").glob("step_*"))
    assert ckpts == ["step_27", "step_30"]  # keep=2


def test_compare_v1_v2_identical(tmp_path, sets):
    out = vlmrun("compare", "v1", "v2", "--recipe", TINY, "--steps", "6", "--out", str(tmp_path), "--json", *sets)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert d["verdict"] == "match" and d["max_abs_diff"]["loss"] == 0.0 and d["sample_ids_identical"]
    assert d["steps_compared"] == 6 and Path(d["plot"]).is_file()
    parts = d["throughput_ratio"]["parts"]  # v1, v2, v1: the runs took turns (--rounds 2)
    assert [p["run"] for p in parts] == ["v1", "v2", "v1"] and d["throughput_ratio"]["rounds"] == 2


@pytest.mark.parametrize("kill_at", [4, 7])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, sets, uninterrupted, kill_at):
    run = tmp_path / "b"
    proc = start("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--wait")
    try:
        deadline = time.time() + 300
        while last_step(run) < kill_at and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert last_step(run) >= kill_at
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    same_history(uninterrupted, run)
    job = json.loads((run / "job.json").read_text())
    assert [a["state"] for a in job["attempts"]] == ["KILLED", "COMPLETED"]
    # no sample lost or seen twice across the kill: per epoch, the same ids as often as uninterrupted
    assert epoch_ids(run) == epoch_ids(uninterrupted) and sum(epoch_ids(run)[0].values()) == 240
    cmp = vlmrun("compare", str(uninterrupted), str(run), "--json", "--out", str(tmp_path / "cmp"))
    assert cmp.returncode == 0 and json.loads(cmp.stdout)["verdict"] == "match"


@pytest.mark.parametrize("stop_at", [2, 5])
def test_sigusr2_checkpoints_at_step_boundary_and_resumes_without_recompute(tmp_path, sets, uninterrupted, stop_at):
    run = tmp_path / "c"
    proc = start("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--wait")
    deadline = time.time() + 300
    while last_step(run) < stop_at and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGUSR2)
    assert proc.wait(timeout=300) == 3  # stopped at a checkpoint, resumable
    job = json.loads((run / "job.json").read_text())
    stopped_at = job["attempts"][-1]["last_step"]
    assert job["state"] == "STOPPED" and (run / "checkpoints" / f"step_{stopped_at}").is_dir()
    assert last_step(run) == stopped_at
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30  # nothing recomputed
    same_history(uninterrupted, run)


def test_resume_refuses_another_layout(tmp_path, sets, uninterrupted):
    run = tmp_path / "d"
    out = vlmrun(
        "submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--set", "train.max_steps=3", "--wait"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    recipe = (run / "recipe.yaml").read_text().replace("dp: 2", "dp: 1")
    (run / "recipe.yaml").write_text(recipe)
    out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 2
    assert "parallel.dp: 2 -> 1" in out.stderr
