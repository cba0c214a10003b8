"""SFT end to end on the embedded default: real Ray, real Energon, the real tiny Qwen2.5-VL, via the CLI.

The uninterrupted run (the session's `sft_baseline`) writes the run contract; v1 (driver-fed) and v2
(colocated loaders) give bitwise the same numbers, as `vlmrun compare v1 v2` says, its runs taking turns. That an
interrupted run resumes to the numbers of the uninterrupted one is tests/test_chaos_processes.py
(local), test_fsdp_runs.py (FSDP2) and test_slurm_sft.py (SLURM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_runs import SFT_STEPS
from vlmrun_cli import TINY, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow


def test_uninterrupted_run_writes_the_contract(sft_baseline):
    h = history(sft_baseline / "metrics.jsonl")
    assert sorted(h) == list(range(1, SFT_STEPS + 1))
    row = h[10]  # a validation step
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
    assert row["consumed_samples"] == 10 * 8 and len(row["sample_ids"]) == 8
    assert "val_loss" not in h[9]  # validation every train.val_period steps only
    ckpts = sorted(p.name for p in (sft_baseline / "checkpoints").glob("step_*"))
    assert ckpts == ["step_39", "step_40"]  # every 3 steps and the last, keep=2
    job = json.loads((sft_baseline / "job.json").read_text())
    assert job["state"] == "COMPLETED" and job["attempts"][-1]["last_step"] == SFT_STEPS


def test_compare_v1_v2_gives_identical_numbers_taking_turns_that_stop_where_planned(tmp_path, sft_sets):
    """`compare v1 v2 --rounds 2`: v1 (driver-fed) and v2 (colocated loaders) bitwise equal over 34 steps
    of the baseline's recipe (an epoch is 32), v1 run in two parts that each end at their planned step."""
    out = vlmrun(
        *("compare", "v1", "v2", "--recipe", TINY, "--steps", "34", "--rounds", "2", "--json"),
        *("--out", str(tmp_path), *sft_sets),
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert d["verdict"] == "match" and d["max_abs_diff"]["loss"] == 0.0 and d["sample_ids_identical"]
    assert d["steps_compared"] == 34 and Path(d["plot"]).is_file()
    parts = d["throughput_ratio"]["parts"]  # v1, v2, v1: each part ends at its planned step (train.stop_after)
    assert [(p["run"], p["steps"]) for p in parts] == [("v1", [1, 17]), ("v2", [1, 34]), ("v1", [18, 34])]
    assert d["throughput_ratio"]["rounds"] == 2
    job = json.loads((tmp_path / "v1" / "job.json").read_text())
    assert [a["state"] for a in job["attempts"]] == ["STOPPED", "COMPLETED"]
    assert job["attempts"][0]["reason"] == "stop requested (train.stop_after: 17); checkpointed at step 17"
    assert "stop_after: null" in (tmp_path / "v1" / "recipe.yaml").read_text()  # the resume trained on
