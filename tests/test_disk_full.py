"""A disk that fills while a run checkpoints: the save says "no space left on device (<path>, <free>
free, <needed> needed)" wherever it failed (a part's torch.save, DCP, the manifest), the partial
checkpoint goes and the earlier ones stay valid, and the launcher keeps the run directory of a job that
started. On real small file systems (a tmpfs; tests/file_systems.py), unit by unit and through `vlmrun
submit --wait` and `vlmrun resume`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from file_systems import fill, grow, small_disk
from shared_runs import submit_args
from vlmrun_cli import sets, vlmrun

from vlmrun.checkpoint.manifest import RunAtSave
from vlmrun.checkpoint.parts import PolicyState, Storage
from vlmrun.checkpoint.read import verify
from vlmrun.checkpoint.saving import Saves
from vlmrun.checkpoint.store import CheckpointStore
from vlmrun.errors import NoSpaceLeft
from vlmrun.run.metrics import history

MIB = 1 << 20
SAID = re.compile(
    r"no space left on device \((?P<path>[^,]+), (?P<free>[\d.]+ [KMG]?i?B) free, (?P<needed>[\d.]+ [KMG]?i?B) needed\)"
)


def _said(error: BaseException | str) -> dict[str, str]:
    m = SAID.fullmatch(str(error))
    assert m, str(error)
    return m.groupdict()


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def _save(store: CheckpointStore, step: int, floats: int) -> Path:
    pending = store.begin(step)
    files = pending.write("controller", {"counters": {"step": step}})
    files |= pending.write("model", {"w": torch.ones(floats)}) | pending.write("optimizer", {"m": torch.ones(8)})
    files |= pending.write("rng", {"seed": step}, index=0)
    return store.finish(pending, files, RunAtSave(placement_hash="h", layout="dp=1"))


@pytest.fixture
def disk(tmp_path):
    with small_disk(tmp_path / "disk", 4 * MIB) as path:
        yield path


def test_a_part_that_does_not_fit_names_its_file_what_was_free_and_what_it_needed(disk):
    pending = CheckpointStore(disk / "checkpoints", keep=2).begin(1)
    with pytest.raises(NoSpaceLeft) as e:
        pending.write("model", {"w": torch.zeros(2 * MIB)})  # 8 MiB of floats on a 4 MiB disk
    said = _said(e.value)
    assert said["path"] == f"{pending.path}/policy/model.pt" and said["needed"] == "8.0 MiB"
    assert "unexpected pos" not in str(e.value) and e.value.__cause__ is not None  # torch's own error, kept below


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("background", [False, True])
def test_a_sharded_policy_write_that_does_not_fit_says_the_same(disk, background):
    pending = CheckpointStore(disk / "checkpoints", keep=2).begin(1)
    shards = PolicyState(Storage.SHARDED, {"model": {"w": torch.zeros(MIB)}, "optimizer": {"s": torch.ones(9)}})
    with pytest.raises(NoSpaceLeft) as e:
        pending.start_policy_write(shards, rank=0, background=background).result()
    said = _said(e.value)
    assert said["path"] == f"{pending.path}/policy/sharded" and said["needed"] == "4.0 MiB"


def test_a_save_that_fills_the_disk_leaves_no_partial_checkpoint_and_the_earlier_ones_valid(disk):
    store = CheckpointStore(disk / "checkpoints", keep=3)
    for step in (1, 2):
        _save(store, step, 200_000)  # 0.8 MiB each
    size = sum(p.stat().st_size for p in (disk / "checkpoints" / "step_2").rglob("*") if p.is_file())
    pending = store.begin(3)
    with pytest.raises(NoSpaceLeft) as e, Saves(store, check_driver=lambda: None).writing(pending):
        pending.write("model", {"w": torch.ones(200_000)})
        fill(disk)
        pending.write("optimizer", {"m": torch.ones(100_000)})
    said = _said(e.value)
    assert said["path"] == str(disk / "checkpoints") and said["free"] != "0 B"  # what is free once it went
    assert abs(_bytes(said["needed"]) - size) < 0.001 * size  # what a checkpoint of this run takes
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_1", "step_2"]
    found, skipped = store.latest()
    assert found.step == 2 and skipped == []


def test_a_manifest_that_does_not_fit_leaves_the_earlier_checkpoints_valid(disk):
    store = CheckpointStore(disk / "checkpoints", keep=3)
    _save(store, 1, 200_000)
    pending = store.begin(2)
    files = pending.write("controller", {"counters": {"step": 2}}) | pending.write("model", {"w": torch.ones(8)})
    files |= pending.write("optimizer", {"m": torch.ones(8)}) | pending.write("rng", {"seed": 2}, index=0)
    filler = fill(disk)
    with pytest.raises(NoSpaceLeft) as e:
        store.finish(pending, files, RunAtSave(placement_hash="h", layout="dp=1"))
    assert _said(e.value)["path"] == str(disk / "checkpoints") and not Path(pending.path).exists()
    filler.unlink()
    assert store.latest()[0].step == 1
    _save(store, 2, 8)  # space again: the next save of that step goes through
    assert [s for s, _ in store.complete()] == [1, 2]


# ---------------------------------------------------------------- a real run whose disk fills


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_wait_run_whose_disk_fills_keeps_its_run_dir_says_why_and_resumes_once_there_is_space(
    finished_run, run_data, tmp_path
):
    """A checkpoint every step on a disk that holds two: the third save fails. The run directory stays
    (job.json, metrics, logs, two valid checkpoints), the console and job.json say why in one line, and a
    resume after space was freed continues from step 2 to the end."""
    checkpoint = sum(p.stat().st_size for p in (finished_run / "checkpoints" / "step_4").rglob("*") if p.is_file())
    quick = ["train.max_steps=6", "checkpoint.save_period=1", "train.val_samples=0", "data.num_workers=0"]
    with small_disk(tmp_path / "disk", int(2.5 * checkpoint) + MIB) as disk:
        run = disk / "run"
        out = vlmrun(*submit_args(run, *run_data, *sets(*quick, "train.lr_schedule=constant")), timeout=600)
        assert out.returncode == 1, out.stderr[-3000:]
        job = json.loads((run / "job.json").read_text())
        assert job["state"] == "FAILED" and job["attempts"][0]["state"] == "FAILED"
        said = _said(job["reason"].split(" (in ")[0])
        assert said["path"] == str(run / "checkpoints")
        failed = [line for line in out.stderr.splitlines() if "FAILED:" in line]
        assert len(failed) == 1 and "no space left on device (" in failed[0] and "Traceback" not in out.stderr
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_1", "step_2"]
        for step in (1, 2):
            verify(run / "checkpoints" / f"step_{step}")
        assert sorted(history(run / "metrics.jsonl")) == [1, 2, 3] and (run / "logs" / "attempt-0.log").is_file()

        grow(disk, 8 * checkpoint)
        resumed = vlmrun("resume", str(run), "--wait", timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        job = json.loads((run / "job.json").read_text())
        assert job["state"] == "COMPLETED" and job["attempts"][1]["resumed_from"] == 2
        assert sorted(history(run / "metrics.jsonl")) == list(range(1, 7))
