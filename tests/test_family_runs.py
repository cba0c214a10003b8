"""The tiny SFT and GRPO recipes with every model family besides the recipes' own (qwen2_5_vl, which
test_sft.py, test_grpo_e2e.py and test_export.py run), via the CLI with `--set model.family=F`: SFT
trains, validates and seals a checkpoint, and `vlmrun export` of it loads back with the trained model's
logits; GRPO from the random tiny model generates, scores and trains on the family's media through the
data plane. One short run of each per family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from data_samples import FAMILIES, trained_model, val_batch
from shared_runs import submit
from vlmrun_cli import GRPO, TINY, rows, sealed, sets, vlmrun

from vlmrun.config.families import family_spec
from vlmrun.config.load import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: One rank: what these runs check is the family's own path (its media, its export); two ranks of it
#: reduce gradients as every family does (the session's dp=2 runs, tests/test_fsdp_policy.py).
ONE_RANK = "parallel.dp=1"
OTHER_FAMILIES = [f for f in FAMILIES if f not in {load_recipe(TINY).family, load_recipe(GRPO).family}]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_the_sft_recipe_trains_and_its_export_loads_with_the_trained_logits(family, run_data, tmp_path):
    quick = [
        *("train.max_steps=3", "checkpoint.save_period=3", "train.val_period=3", "train.val_samples=8"),
        ONE_RANK,
    ]
    run = submit(tmp_path / "run", *run_data, *sets(f"model.family={family}", "data.num_workers=0", *quick))
    steps = rows(run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["valid_tokens"] > 0 for r in steps)
    assert math.isfinite(steps[-1]["val_loss"]) and steps[-1]["val_samples"] > 0
    assert sealed(run) == [3]

    from transformers import AutoModelForImageTextToText

    out = vlmrun("export", str(run), str(tmp_path / "export"), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    exported_dir = Path(json.loads(out.stdout)["out"])
    assert json.loads((exported_dir / "config.json").read_text())["model_type"] in family_spec(family).model_types
    trained, model_dir = trained_model(run, 3)
    exported = AutoModelForImageTextToText.from_pretrained(exported_dir).eval()
    batch, reference = val_batch(run, str(exported_dir)), val_batch(run, str(model_dir))
    assert torch.equal(batch.input_ids, reference.input_ids) and batch.media.keys() == reference.media.keys()
    assert all(torch.equal(batch.media[k], reference.media[k]) for k in reference.media)
    assert set(batch.token_inputs) == set(family_spec(family).token_keys)
    with torch.no_grad():
        got = exported(**batch.model_inputs(), use_cache=False).logits
        assert torch.equal(got, trained(**batch.model_inputs(), use_cache=False).logits)


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_the_grpo_recipe_trains_on_the_familys_rollouts(family, run_data, tmp_path):
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.val_period=2", "train.val_samples=8"]
    quick = ["train.max_steps=2", "checkpoint.save_period=2", f"model.family={family}", ONE_RANK]
    run = submit(tmp_path / "run", *run_data, *sets(*small, *quick), recipe=GRPO)
    steps = rows(run)
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["loss"]) and row["valid_tokens"] > 0 and row["response_length_mean"] > 0
        assert row["plane_bytes"] > 0 and len(row["sample_ids"]) == 8  # the rollout went through the plane
    assert "val_accuracy" in steps[-1]
    assert sealed(run) == [2]
