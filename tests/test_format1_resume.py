"""A run written by the code before the layered layout (checkpoint format 1, its job.json, loader format 1)
under this code: its checkpoint reads through the same parts, but its loader states hold the stream of
loader format 1, whose shuffle buffer mixed an epoch's tail with the next epoch's head (the exact epochs
of vlmrun.data.epochs changed that order from step 9 of this recipe on). So a plain resume is refused,
naming the change and the way on, and `--restart-data-order` continues the run: model, optimizer, LR
schedule and counters from step 9, the data order from its start.

The fixture (tests/fixtures/format1-run) was written by vlmrun at commit 69db7bc: 40 steps of a tiny
Qwen2.5-VL at dp=2, SGD, stopped with SIGUSR2 after step 9. It holds recipe.yaml, job.json,
metrics.jsonl (steps 1-9) and checkpoints/step_9 (meta.json, model.pt, optim.pt, controller.pt,
rng/rank_*.pt, loader/shard_*.pt). The recipe's data.path is absolute (the loader fingerprint holds
it), so the synthetic data set is generated at that fixed path on first use.
"""

from __future__ import annotations

import json
import shutil

import pytest
from vlmrun_cli import ROOT, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "fixtures" / "format1-run"


def test_format1_run_resumes_with_its_data_order_restarted(tmp_path):
    old, fresh = tmp_path / "old", tmp_path / "fresh"
    shutil.copytree(FIXTURE, old)
    refused = vlmrun("resume", str(old), "--wait")
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = refused.stdout + refused.stderr
    assert "versions.loader_format: 1 -> 2" in said and "--restart-data-order" in said, said[-3000:]
    assert "Traceback" not in said
    resumed = vlmrun("resume", str(old), "--restart-data-order", "--wait")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = vlmrun("submit", str(old / "recipe.yaml"), "--cluster", "local", "--run-dir", str(fresh), "--wait")
    assert straight.returncode == 0, straight.stderr[-3000:]

    a, b = history(old / "metrics.jsonl"), history(fresh / "metrics.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 41))
    for step in range(1, 41):  # the LR schedule and the counters came back from step 9
        for key in ("lr", "consumed_samples"):
            assert a[step][key] == b[step][key], (step, key)
    for step in range(1, 9):  # 32 of a shard's 48 samples: the two loader formats' orders agree up to there
        assert a[step]["sample_ids"] == b[step]["sample_ids"], step
    for step in range(10, 41):  # the data order started over at step 10, on the model of step 9
        assert a[step]["sample_ids"] == b[step - 9]["sample_ids"], step
    assert a[10]["loss"] != b[1]["loss"]
    assert {a[s]["attempt"] for s in range(10, 41)} == {2}

    job = json.loads((old / "job.json").read_text())
    assert [x["state"] for x in job["attempts"]] == ["STOPPED", "FAILED", "COMPLETED"]
    assert job["attempts"][2]["resumed_from"] == 9 and job["state"] == "COMPLETED"
    assert (old / "checkpoints" / "step_40" / "manifest.json").is_file()
