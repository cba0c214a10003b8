"""`vlmrun eval`: a run's checkpoint scored as the run's own validation scores it gives exactly that
step's metrics row, for SFT and GRPO; its export gives the same numbers; a second target is compared;
bad targets are refused naming the argument."""

from __future__ import annotations

import json
import math

import pytest
from vlmrun_cli import refused, vlmrun

from vlmrun.launch.eval import ROW_KEYS
from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow


def evaluated(*args: str) -> dict:
    done = vlmrun("eval", *args, "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr
    return json.loads(done.stdout)


def row_at(run, step: int) -> dict:
    return {k: history(run / "metrics.jsonl")[step][k] for k in ROW_KEYS}


def test_a_checkpoint_and_its_export_give_the_runs_own_validation_numbers(sft_baseline, grpo_policy):
    got = evaluated(str(sft_baseline))
    assert got["kind"] == "checkpoint" and got["matches_run_row"] is True
    assert {k: got[k] for k in ROW_KEYS} == row_at(sft_baseline, got["step"]) == got["run_row"]
    assert got["val_samples"] == 8 and math.isfinite(got["val_loss"])
    assert sum(t["answered"] for t in got["templates"].values()) == got["val_samples"]
    assert sum(t["correct"] for t in got["templates"].values()) == round(got["val_accuracy"] * 8)
    exported = evaluated(str(grpo_policy))  # the export of the baseline's newest checkpoint
    assert exported["kind"] == "model" and exported["matches_run_row"] is None
    assert {k: exported[k] for k in ROW_KEYS} == {k: got[k] for k in ROW_KEYS}
    assert exported["templates"] == got["templates"] and exported["reward"] == got["reward"]


def test_a_grpo_checkpoint_matches_its_row_and_scores_the_recipes_reward(grpo_want):
    rows = history(grpo_want / "metrics.jsonl")
    step = max(
        s
        for s, r in rows.items()
        if r.get("val_loss") is not None and (grpo_want / "checkpoints" / f"step_{s}").is_dir()
    )
    got = evaluated(str(grpo_want), "--step", str(step))
    assert got["step"] == step and got["matches_run_row"] is True and got["run_row"] == row_at(grpo_want, step)
    assert got["reward"]["fn"] == ["clevr_exact"] and 0.0 <= got["reward"]["mean"] <= 1.5


def test_against_a_second_target_gives_both_and_the_differences(sft_baseline, grpo_want, run_data):
    both = evaluated(str(sft_baseline), "--against", str(grpo_want), "--samples", "4")
    a, b = both["a"], both["b"]
    assert a["data"] == b["data"] and a["val_samples"] == b["val_samples"] == 4
    assert a["matches_run_row"] is None  # 4 samples: not the run's validation
    assert both["delta"]["val_loss"] == b["val_loss"] - a["val_loss"]


def test_bad_targets_are_refused_naming_the_argument(sft_baseline, tmp_path):
    assert "neither a run directory" in refused(vlmrun("eval", str(tmp_path)), "TARGET")
    plain = tmp_path / "model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert "vlmrun export" in refused(vlmrun("eval", str(plain)), "--recipe")
    assert "no checkpoint of step 999" in refused(vlmrun("eval", str(sft_baseline), "--step", "999"), "--step")
    assert refused(vlmrun("eval", str(sft_baseline), "--split", "nope"), "--split")
