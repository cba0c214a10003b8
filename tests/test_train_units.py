"""Unit tests of the training core's logic: checkpoint store, data plane, schedule, step plan, stop flag."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from vlmrun.algorithms.common.steps import plan_steps
from vlmrun.algorithms.common.stop import StopFlag
from vlmrun.config.load import load_recipe
from vlmrun.plane.interface import DataPlaneError, PartitionSpec
from vlmrun.plane.local import LocalDataPlane
from vlmrun.policy.lr_schedule import lr_factor
from vlmrun.policy.rng import rng_state, seed_all, set_rng_state
from vlmrun.run.rows import NUMBER_KEYS, GrpoStats, StepRow, Validation

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"
#: The keys of every SFT row, in the order users see them (vlmrun/run/rows.py).
SFT_KEYS = """step attempt epoch loss grad_norm lr valid_tokens consumed_samples dropped_samples truncated_samples sample_ids step_time_s
loader_latency_max_s tokens_per_s samples_per_s peak_rss_mb time""".split()


def step_row(**values) -> StepRow:
    """A row with every common key; `values` override them (and may add `grpo`, `validation`)."""
    base = dict(step=1, attempt=0, epoch=0, loss=1.0, grad_norm=0.5, lr=1e-3, valid_tokens=16, consumed_samples=8)
    base |= dict(sample_ids=["a"], step_time_s=0.1, loader_latency_max_s=0.0, tokens_per_s=160.0, samples_per_s=80.0)
    return StepRow(**(base | {"peak_rss_mb": 800.0, "time": 1796123343.042} | values))


def test_data_plane_one_write_per_field_then_clear():
    plane = LocalDataPlane()
    plane.register("step-1", PartitionSpec.reading({"advantage": ["rewards"]}, 2))
    plane.put("step-1", ["a", "b"], {"rewards": [torch.tensor(1.0), torch.tensor(2.0)]})
    with pytest.raises(DataPlaneError, match="already written"):
        plane.put("step-1", ["a", "b"], {"rewards": [torch.tensor(3.0), torch.tensor(4.0)]})
    assert plane.get("step-1", ["b"], ["rewards"]).stack("rewards").tolist() == [2.0]
    assert plane.list_sample_ids("step-1") == ["a", "b"]
    restored = LocalDataPlane()
    restored.load_state_dict(plane.state_dict())
    assert restored.get("step-1", ["a", "b"], ["rewards"]).stack("rewards").tolist() == [1.0, 2.0]
    plane.clear("step-1")
    assert plane.partitions() == [] and plane.state_dict() == {}


def test_lr_schedule_warmup_then_cosine_to_min():
    kw = dict(max_steps=100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, **kw) == pytest.approx(0.1)
    assert lr_factor(9, **kw) == pytest.approx(1.0)
    assert lr_factor(10, **kw) == pytest.approx(1.0)
    assert lr_factor(100, **kw) == pytest.approx(0.1)
    assert lr_factor(55, **kw) == pytest.approx(0.55)
    assert lr_factor(50, max_steps=100, warmup_steps=0, schedule="constant", min_lr_ratio=0.0) == 1.0


def test_adamw_state_allocated_for_a_resume_steps_like_a_fresh_optimizer():
    """`allocate_state` (the target a resume's load fills) is the state a fresh AdamW starts from: the
    same steps follow whether or not a load came; torch's own init (a zero-gradient step) is not."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from vlmrun.config.train import TrainConfig
    from vlmrun.policy.optimizer import allocate_state, build_optimizer

    torch.manual_seed(0)
    start, grads = torch.randn(4, 3), [torch.randn(4, 3) for _ in range(3)]

    def trained(prepare) -> torch.Tensor:
        w = torch.nn.Parameter(start.clone())
        optimizer, _ = build_optimizer([w], TrainConfig(weight_decay=0.1), max_steps=10)
        prepare(optimizer)
        for g in grads:
            w.grad = g.clone()
            optimizer.step()
        return w.detach()

    fresh = trained(lambda o: None)
    assert torch.equal(trained(allocate_state), fresh)
    assert not torch.equal(trained(_init_optim_state), fresh)  # its step count starts at 1


def test_step_plan_caps_by_epochs():
    r = load_recipe(TINY, ["train.max_steps=1000", "train.epochs=2"])
    plan = plan_steps(r, train_samples=80)
    assert plan.steps_per_epoch == 10 and plan.max_steps == 20
    assert plan.samples_per_replica == 4 and plan.micro_batches_per_replica == 2
    assert plan.epoch_of(10) == 0 and plan.epoch_of(11) == 1
    r = load_recipe(TINY, ["train.max_steps=5", "data.virtual_epoch_length=3"])
    assert plan_steps(r, train_samples=80).max_steps == 3


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    seed_all(7)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_stop_flag_set_by_signal_only():
    flag = StopFlag().install([signal.SIGUSR2])
    try:
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.wait(2) and flag.signal_name == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_metrics_log_drops_a_torn_row_and_readers_take_latest_attempt(tmp_path):
    from vlmrun.run.metrics import MetricsLog, history

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append(step_row(step=1, attempt=0, loss=2.0))
    log.append(step_row(step=2, attempt=0, loss=1.5))
    with open(path, "a") as f:
        f.write('{"step": 3, "attempt": 0, "lo')  # killed mid-write
    log = MetricsLog(path)
    log.append(step_row(step=2, attempt=1, loss=1.5))
    log.append(step_row(step=3, attempt=1, loss=1.2))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4
    h = history(path)
    assert sorted(h) == [1, 2, 3] and h[3]["attempt"] == 1 and h[1]["attempt"] == 0


def test_token_logprobs_sum_to_minus_nll():
    from vlmrun.data.batch import IGNORE_INDEX
    from vlmrun.policy.loss import nll_sum, token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = IGNORE_INDEX
    lp = token_logprobs(logits, labels)
    assert lp.shape == (2, 4) and float(lp[0, :2].abs().sum()) == 0.0
    assert torch.allclose(-lp.sum(), nll_sum(logits, labels))


def test_a_step_row_writes_the_contracts_keys_and_grpo_and_validation_keys_inline(tmp_path):
    from vlmrun.run.metrics import MetricsLog, history

    grpo = GrpoStats(
        **dict.fromkeys(
            "reward accuracy format_rate probs_ratio_min probs_ratio_max kl token_mult_prob_error "
            "sampling_importance_ratio gen_kl_error clip_fraction advantage_mean advantage_min advantage_max "
            "response_length_mean time_rollout_s time_generation_s time_refit_s time_reward_s time_logprob_s "
            "time_advantage_s time_train_s time_data_plane_s data_plane_fraction generation_tokens_per_s".split(),
            0.5,
        ),
        accuracy_by_template={"count_all": 0.25},
        plane_stage_s={"rollout": 0.01, "advantage_beside": 0.02},
        response_length_max=7,
        plane_bytes=1024,
    )
    validation = Validation(val_loss=0.7, val_accuracy=0.4, val_samples=8, val_tokens=16, val_majority_baseline=0.3)
    sft = step_row().to_json()
    assert list(sft) == SFT_KEYS
    row = step_row(step=2, grpo=grpo).with_validation(validation).to_json()
    assert list(row)[: len(SFT_KEYS) - 1] == SFT_KEYS[:-1]  # the common keys first, then GRPO's, time, validation's
    assert row["accuracy/count_all"] == 0.25 and row["time_plane_advantage_beside_s"] == 0.02
    assert "accuracy_by_template" not in row and "plane_stage_s" not in row and "grpo" not in row
    assert (
        row["plane_bytes"] == 1024
        and row["val_loss"] == 0.7
        and list(row)[-len(dataclasses.fields(Validation)) :] == [f.name for f in dataclasses.fields(Validation)]
    )
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append(step_row())
    log.append(step_row(step=2, grpo=grpo).with_validation(validation))
    assert history(tmp_path / "metrics.jsonl")[2] == json.loads(json.dumps(row))


def test_readers_check_every_number_the_row_type_declares(tmp_path):
    from vlmrun.errors import InputError
    from vlmrun.run.metrics import history

    for key in ("loss", "reward", "plane_bytes", "val_tokens", "val_loss"):
        assert key in NUMBER_KEYS
    assert "sample_ids" not in NUMBER_KEYS and "step" in NUMBER_KEYS
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "val_loss": None, "reward": 0.5}) + "\n")
    assert history(path)[1]["val_loss"] is None  # null: not measured
    path.write_text(json.dumps({"step": 1, "reward": "high"}) + "\n")
    with pytest.raises(InputError, match="reward is 'high', not a number"):
        history(path)
