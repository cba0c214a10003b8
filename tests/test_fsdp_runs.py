"""FSDP2 runs through the CLI on CPU (dp=2, gloo): the same numbers as the replicated layout, SIGKILL +
`vlmrun resume` from sharded DCP checkpoints, export from them, and a resume at another dp only with
--restart-data-order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from data_samples import text_only, write_corrupt_copy
from test_sft import TINY, last_step, start, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    from vlmrun.datasets.clevr import generate_clevr

    work = tmp_path_factory.mktemp("data")
    generate_clevr(work / "clevr", train=128, val=16, image_size=112, seed=0)
    # every other sample without its image: a quarter of the micro-batches are text-only, a quarter all images
    mixed = write_corrupt_copy(work / "clevr", work / "mixed", {f"train-{i:07d}": text_only for i in range(0, 128, 2)})
    pairs = {
        "data.path": str(mixed),
        "train.max_steps": str(STEPS),
        "checkpoint.save_period": "2",
        "train.val_samples": "4",
        "train.val_period": "4",
        "logger.wandb_mode": "disabled",
    }
    return [arg for k, v in pairs.items() for arg in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, sets) -> Path:
    run = tmp_path_factory.mktemp("runs") / "replicated"
    out = vlmrun(
        "submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--set", "parallel.fsdp=false", "--wait"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, sets) -> Path:
    """An FSDP2 run SIGKILLed after step 5, then resumed to the end."""
    run = tmp_path_factory.mktemp("runs") / "sharded"
    proc = start(
        "submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--set", "parallel.fsdp=true", "--wait"
    )
    try:
        deadline = time.time() + 300
        while last_step(run) < 5 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert last_step(run) >= 5
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_sharded_run_killed_and_resumed_equals_the_replicated_run(replicated, sharded, tmp_path):
    cmp = vlmrun("compare", str(replicated), str(sharded), "--json", "--out", str(tmp_path / "cmp"))
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr[-2000:]
    d = json.loads(cmp.stdout)
    assert d["verdict"] == "match" and d["max_abs_diff"]["loss"] == 0.0 and d["max_abs_diff"]["grad_norm"] == 0.0
    assert d["steps_compared"] == STEPS
    job = json.loads((sharded / "job.json").read_text())
    assert [a["state"] for a in job["attempts"]] == ["KILLED", "COMPLETED"]
    shards = sorted(p.name for p in (sharded / "checkpoints" / f"step_{STEPS}" / "policy" / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    assert (
        history(sharded / "metrics.jsonl")[STEPS]["val_loss"]
        == history(replicated / "metrics.jsonl")[STEPS]["val_loss"]
    )


def test_export_of_a_sharded_checkpoint_equals_the_replicated_export(replicated, sharded, tmp_path):
    from safetensors.torch import load_file

    weights = {}
    for name, run in (("replicated", replicated), ("sharded", sharded)):
        out = vlmrun("export", str(run), str(tmp_path / name))
        assert out.returncode == 0, out.stderr[-2000:]
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    assert weights["sharded"].keys() == weights["replicated"].keys()
    for key, w in weights["replicated"].items():
        assert torch.equal(weights["sharded"][key], w), key


def test_resume_at_another_dp_needs_restart_data_order(sharded, tmp_path):
    recipe_before = (sharded / "recipe.yaml").read_text()
    out = vlmrun("resume", str(sharded), "--set", f"train.max_steps={STEPS + 2}", "--set", "parallel.dp=1")
    assert out.returncode == 2
    assert (
        "parallel.dp" in out.stderr and "loader shard's position" in out.stderr and "--restart-data-order" in out.stderr
    )
    assert (sharded / "recipe.yaml").read_text() == recipe_before  # nothing written, nothing started
    out = vlmrun(
        "resume",
        str(sharded),
        "--restart-data-order",
        "--set",
        f"train.max_steps={STEPS + 2}",
        "--set",
        "parallel.dp=1",
        "--wait",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    attempt = json.loads((sharded / "job.json").read_text())["attempts"][-1]
    assert attempt["state"] == "COMPLETED" and attempt["resumed_from"] == STEPS
    assert "dp=2" in attempt["restarted_data_order"] and "data order starts over" in attempt["restarted_data_order"]
    h = history(sharded / "metrics.jsonl")
    assert sorted(h) == list(range(1, STEPS + 3)) and h[STEPS + 1]["consumed_samples"] == (STEPS + 1) * 8
