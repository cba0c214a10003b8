"""Unit tests of the training core's logic: checkpoint store, data plane, schedule, step plan, stop flag."""

from __future__ import annotations

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

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"


def test_data_plane_one_write_per_field_then_clear():
    plane = LocalDataPlane()
    plane.register("step-1", PartitionSpec.for_stages("qwen2_5_vl", ["advantage"], 2))
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
    log.append({"step": 1, "attempt": 0, "loss": 2.0})
    log.append({"step": 2, "attempt": 0, "loss": 1.5})
    with open(path, "a") as f:
        f.write('{"step": 3, "attempt": 0, "lo')  # killed mid-write
    log = MetricsLog(path)
    log.append({"step": 2, "attempt": 1, "loss": 1.5})
    log.append({"step": 3, "attempt": 1, "loss": 1.2})
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
