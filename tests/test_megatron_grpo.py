"""GRPO on the megatron backend through the CLI: step 1 of the tiny recipe at tp=2 (the local plane, the
policy offloaded around the rollout), pp=2 (TransferQueue, simple storage; with validation, answered by each replica's first rank) and tp=2 (the driver path,
data_plane.enabled: false) gives the hf backend's rewards exactly and its loss to 1e-5, the same
responses from the same initial weights; every ratio is exactly 1 at every step. (SFT:
tests/test_megatron_runs.py.)
"""

from __future__ import annotations

import pytest
from shared_runs import submit
from vlmrun_cli import GRPO, sets

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow  # real runs through the CLI, 2 ranks each

GRPO_QUICK = ["train.max_steps=2", "train.global_batch_size=4", "grpo.num_generations=4", "train.val_samples=0"]
GRPO_QUICK += ["parallel.dp=1", "checkpoint.save_period=2"]


@pytest.fixture(scope="module")
def grpo_hf(tmp_path_factory, run_data):
    return submit(tmp_path_factory.mktemp("grpo-hf") / "run", *run_data, *sets(*GRPO_QUICK), recipe=GRPO)


@pytest.mark.parametrize(
    "plane",
    [
        ["parallel.tp=2", "parallel.offload_during_generation=true"],  # the local plane (the recipe's)
        ["parallel.pp=2", "data_plane.impl=transfer_queue", "train.val_samples=4", "train.val_period=2"],
        ["parallel.tp=2", "data_plane.enabled=false"],
    ],
    ids=["tp2-local", "pp2-transfer_queue", "tp2-driver"],
)
def test_grpo_step_1_gives_the_hf_backends_rewards_and_loss_on_every_data_plane(tmp_path, run_data, grpo_hf, plane):
    run = submit(tmp_path / "run", *run_data, *sets(*GRPO_QUICK, "model.backend=megatron", *plane), recipe=GRPO)
    got, want = history(run / "metrics.jsonl"), history(grpo_hf / "metrics.jsonl")
    assert all(got[1][k] == want[1][k] for k in ("reward", "accuracy", "format_rate", "response_length_mean"))
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-5, abs=1e-7)
    assert all(got[s]["probs_ratio_min"] == got[s]["probs_ratio_max"] == 1.0 for s in got)
