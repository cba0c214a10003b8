"""Runs written by earlier vlmruns, one for each older checkpoint format, resume under this code, and
the numbers are those of an uninterrupted run of this code, bit for bit.

Each fixture (tests/fixtures/format<N>-run) is 40 steps of a tiny Qwen2.5-VL at dp=2, SGD, stopped
after step 9, written by the vlmrun of its time: format 1 (commit 69db7bc, before the layered layout:
meta.json, model.pt, optim.pt, controller.pt, loader and plane state in one loader/shard_<r>.pt; no
run id), format 2 (commit 0006ac5: sha256 checksums, controller.pt; run.json and owner.json) and format
3 (commit 4193266: XXH3-128 checksums, controller.pt). Each holds recipe.yaml, job.json, metrics.jsonl
(steps 1-9) and checkpoints/step_9. The recipes' data.path is one absolute path (the loader fingerprint
holds it), so the synthetic data set is generated there on first use. What the readers of each format
give back, part by part: tests/test_checkpoint_store.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
from vlmrun_cli import ROOT, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

FIXTURES = ROOT / "tests" / "fixtures"


#: The fixtures' run, uninterrupted, as the vlmrun of format 3 (4193266) trained it here: 40 steps of loader
#: format 1, the stream every run of these formats reads (vlmrun.data.fingerprint). A new run reads the
#: current format (exact epochs), so no run of this code can make this reference: it is pinned.
UNINTERRUPTED = FIXTURES / "loader-format-1-uninterrupted.jsonl"


@pytest.fixture(scope="module")
def uninterrupted():
    return history(UNINTERRUPTED)


@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_a_run_of_each_older_format_resumes_to_the_numbers_of_an_uninterrupted_run(tmp_path, uninterrupted, fmt):
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / f"format{fmt}-run", old)
    resumed = vlmrun("resume", str(old), "--wait")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = history(old / "metrics.jsonl"), uninterrupted
    assert sorted(a) == sorted(b) == list(range(1, 41))
    for step in range(1, 41):  # steps 1-9 by the old code, 10-40 resumed by this one
        for key in ("lr", "valid_tokens", "sample_ids", "consumed_samples"):
            assert a[step][key] == b[step][key], (step, key)
    # The fixtures' steps 1-9 and the reference were computed by different vlmruns and machines (format
    # 1's on an AVX-512 one): their losses may differ in the last bits (5.785025597 against 5.785025477
    # at step 3). Where steps 1-9 agree bit for bit, so must every step; elsewhere each is the
    # uninterrupted run's up to that rounding, carried through the resumed steps.
    same_cpu = all(a[s][k] == b[s][k] for s in range(1, 10) for k in ("loss", "grad_norm"))
    for step in range(1, 41):
        for key in ("loss", "grad_norm"):
            if same_cpu:
                assert a[step][key] == b[step][key], (step, key)
            else:
                assert a[step][key] == pytest.approx(b[step][key], rel=1e-5), (step, key)
    assert {a[s]["attempt"] for s in range(10, 41)} == {1}

    job = json.loads((old / "job.json").read_text())
    assert [x["state"] for x in job["attempts"]] == ["STOPPED", "COMPLETED"]
    assert job["attempts"][1]["resumed_from"] == 9 and job["state"] == "COMPLETED"
    manifest = json.loads((old / "checkpoints" / "step_40" / "manifest.json").read_text())
    assert manifest["format"] == 4 and manifest["identity"]["train.seed"] == 1234
    assert manifest["loader_format"] == 1  # the run keeps the stream it began with


def test_a_resume_that_restarts_the_data_order_moves_an_older_run_to_exact_epochs(tmp_path):
    """`vlmrun resume --restart-data-order` at the same layout: the model, optimizer and counters carry on
    and the data order starts over in the current loader format, whose epochs take every sample once."""
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / "format3-run", old)
    resumed = vlmrun("resume", str(old), "--restart-data-order", "--wait")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, want = history(old / "metrics.jsonl"), history(UNINTERRUPTED)
    assert sorted(a) == list(range(1, 41)) and all(a[s]["lr"] == want[s]["lr"] for s in a)
    assert [a[s]["consumed_samples"] for s in (9, 10)] == [72, 80]  # the counters carry on
    epoch = [i for s in range(10, 22) for i in a[s]["sample_ids"]]  # 96 samples: 12 steps of 8
    assert len(epoch) == len(set(epoch)) == 96  # every sample once (loader format 1 repeated some)
    manifest = json.loads((old / "checkpoints" / "step_40" / "manifest.json").read_text())
    assert (
        manifest["loader_format"] == 2
        and "restarted_data_order" in json.loads((old / "job.json").read_text())["attempts"][1]
    )
