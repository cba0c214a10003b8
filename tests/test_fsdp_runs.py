"""FSDP2 runs through the CLI on CPU (dp=2, gloo): SIGKILLed and resumed with `vlmrun resume` from
sharded DCP checkpoints, written in the step (the first attempt) and in the background while the next
steps train (`checkpoint.async_save`, the second), the same numbers as the session's replicated
`sft_baseline` at every step;
an export from them equal to the replicated export; a resume at another dp only with
--restart-data-order. (Text-only micro-batches under FSDP2, bitwise: tests/test_fsdp_policy.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shared_runs import SFT_STEPS
from vlmrun_cli import TINY, Launcher, job, sealed, sets, states, vlmrun, wait_for

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, sft_sets) -> Path:
    """An FSDP2 run SIGKILLed once it sealed its checkpoint of step 6; resumed with async saves and
    SIGKILLed again once it sealed step 12's; then resumed to the end (from a checkpoint written in
    the background)."""
    folder = tmp_path_factory.mktemp("sharded")
    run = folder / "run"
    submit = ["submit", TINY, "--cluster", "local", "--run-dir", str(run), *sft_sets, *sets("parallel.fsdp=true")]
    for n, (args, step) in enumerate([(submit, 6), (["resume", str(run), *sets("checkpoint.async_save=true")], 12)]):
        launcher = Launcher(folder, *args, "--wait", name=f"attempt-{n}")
        try:
            ended = launcher.proc.poll
            wait_for(lambda s=step, e=ended: s in sealed(run) or e() is not None, 300, f"the checkpoint of step {step}")
            assert step in sealed(run), launcher.stderr()[-3000:]
        finally:
            launcher.kill_group()
            launcher.proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_sharded_run_killed_and_resumed_equals_the_replicated_run(sft_baseline, sharded, tmp_path):
    cmp = vlmrun("compare", str(sft_baseline), str(sharded), "--json", "--out", str(tmp_path / "cmp"))
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr[-2000:]
    d = json.loads(cmp.stdout)
    assert d["verdict"] == "match" and d["max_abs_diff"]["loss"] == 0.0 and d["max_abs_diff"]["grad_norm"] == 0.0
    assert d["steps_compared"] == SFT_STEPS
    attempts = job(sharded)["attempts"]
    assert states(sharded) == ["KILLED", "KILLED", "COMPLETED"] and attempts[2]["resumed_from"] >= 12
    assert len(attempts[2]["checkpoint_write_s"]) >= 1  # its saves were written in the background too
    assert attempts[2]["policy_load"] == "from the checkpoint it resumed (the model's own weights not read)"
    shards = sorted(p.name for p in (sharded / "checkpoints" / f"step_{SFT_STEPS}" / "policy" / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    a, b = history(sharded / "metrics.jsonl"), history(sft_baseline / "metrics.jsonl")
    assert a[SFT_STEPS]["val_loss"] == b[SFT_STEPS]["val_loss"] is not None


def test_export_of_a_sharded_checkpoint_equals_the_replicated_export(grpo_policy, sharded, tmp_path):
    from safetensors.torch import load_file

    out = vlmrun("export", str(sharded), str(tmp_path / "sharded"))
    assert out.returncode == 0, out.stderr[-2000:]
    got = load_file(tmp_path / "sharded" / "model.safetensors")
    want = load_file(grpo_policy / "model.safetensors")  # the session's `vlmrun export` of sft_baseline
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert torch.equal(got[key], w), key


def test_resume_at_another_dp_needs_restart_data_order(sharded, tmp_path):
    more = sets(f"train.max_steps={SFT_STEPS + 2}", "parallel.dp=1")
    recipe_before = (sharded / "recipe.yaml").read_text()
    out = vlmrun("resume", str(sharded), *more)
    assert out.returncode == 2
    assert (
        "parallel.dp" in out.stderr and "loader shard's position" in out.stderr and "--restart-data-order" in out.stderr
    )
    assert (sharded / "recipe.yaml").read_text() == recipe_before  # nothing written, nothing started
    out = vlmrun("resume", str(sharded), "--restart-data-order", *more, "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    attempt = job(sharded)["attempts"][-1]
    assert attempt["state"] == "COMPLETED" and attempt["resumed_from"] == SFT_STEPS
    assert "dp=2" in attempt["restarted_data_order"] and "data order starts over" in attempt["restarted_data_order"]
    h = history(sharded / "metrics.jsonl")
    assert sorted(h) == list(range(1, SFT_STEPS + 3)) and h[SFT_STEPS + 1]["consumed_samples"] == (SFT_STEPS + 1) * 8
