"""A copied run directory (`cp -a`: the same run.json, so the same run id) never writes, counts or
deletes the original's checkpoints: with checkpoints of its own it goes on as a fork (a run id of its
own), with the original's checkpoint.dir it is refused naming that folder and how to go on; a moved run
directory (`mv`) stays the same run. Real run directories and checkpoint stores, no job (the runs
through the CLI: tests/test_checkpoint_runs.py, tests/test_run_copies.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vlmrun.checkpoint.copies import CopySharesCheckpoints, original_of, settle_copy
from vlmrun.checkpoint.owner import CLAIM
from vlmrun.checkpoint.store import CheckpointStore, run_checkpoints
from vlmrun.config.load import load_recipe
from vlmrun.run.directory import RunDirectory

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-clevr-cpu.yaml"


def cp_a(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def _save(store: CheckpointStore, step: int) -> None:
    pending = store.begin(step)
    files = pending.write("controller", {"counters": {"step": step}})
    files |= {f: d for p in ("model", "optimizer") for f, d in pending.write(p, {"w": torch.ones(4)}).items()}
    store.finish(pending, files, None)


def made_run(path: Path, *overrides: str) -> RunDirectory:
    """A run directory with checkpoints of steps 2 and 4 (keep 2), its folder claimed as its job claims it."""
    rd = RunDirectory(path)
    recipe = load_recipe(TINY, ["checkpoint.keep=2", *overrides], base_dir=path.parent)
    rd.create(recipe)
    store = run_checkpoints(rd, recipe)
    store.claim()
    for step in (2, 4):
        _save(store, step)
    return rd


def steps(rd: RunDirectory) -> list[int]:
    return [s for s, _ in run_checkpoints(rd, rd.load_recipe(), assign=False).complete()]


def claim(folder: Path) -> dict:
    return json.loads((folder / CLAIM).read_text())


def test_a_copy_with_its_checkpoints_inside_goes_on_as_a_fork_that_adopts_them(tmp_path):
    a = made_run(tmp_path / "a")
    b = RunDirectory(cp_a(a.path, tmp_path / "b"))
    parent = a.run_id()
    assert original_of(a, a.load_recipe()) is None and original_of(b, b.load_recipe()).path == a.path
    fork = settle_copy(b, b.load_recipe())
    assert (fork.from_run_id, fork.from_run_dir) == (parent.value, str(a.path)) and fork.run_id != parent.value
    assert b.run_id().value == fork.run_id and b.run_id().ancestors == (parent.value,) and b.home() == b.path
    assert (
        claim(b.path / "checkpoints")["run_id"] == fork.run_id
        and claim(a.path / "checkpoints")["run_id"] == parent.value
    )
    store = run_checkpoints(b, b.load_recipe())
    assert store.latest()[0].step == 4  # the checkpoints it brought along are its own
    _save(store, 6)  # keep 2: its copy of step 2 goes
    assert steps(b) == [4, 6] and steps(a) == [2, 4] and a.run_id() == parent
    assert original_of(b, b.load_recipe()) is None and settle_copy(b, b.load_recipe()) is None  # a fork once


def test_a_copy_on_the_originals_checkpoint_dir_is_refused_until_it_has_a_folder_of_its_own(tmp_path):
    folder = tmp_path / "shared-checkpoints"
    a = made_run(tmp_path / "a", f"checkpoint.dir={folder}")
    b = RunDirectory(cp_a(a.path, tmp_path / "b"))
    run_json = (b.path / "run.json").read_text()
    for refusing in (original_of, settle_copy):
        with pytest.raises(CopySharesCheckpoints) as e:
            refusing(b, b.load_recipe())
        assert e.value.field == "checkpoint.dir" and e.value.exit_code == 2
        for words in (str(folder), str(a.path), f"vlmrun resume {b.path} --set checkpoint.dir="):
            assert words in str(e.value), str(e.value)
    assert (b.path / "run.json").read_text() == run_json  # refused before it changed anything
    mine = cp_a(folder, tmp_path / "b-checkpoints")  # a copy of the original's folder: its own
    recipe = b.load_recipe().model_copy(
        update={"checkpoint": b.load_recipe().checkpoint.model_copy(update={"dir": str(mine)})}
    )
    fork = settle_copy(b, recipe)
    assert fork is not None and claim(mine)["run_id"] == fork.run_id and claim(folder)["run_id"] == a.run_id().value
    assert run_checkpoints(b, recipe).latest()[0].step == 4


def test_a_moved_run_dir_is_the_same_run_and_records_where_it_is(tmp_path):
    a = made_run(tmp_path / "a")
    parent = a.run_id()
    moved = RunDirectory(shutil.move(a.path, tmp_path / "moved"))
    assert original_of(moved, moved.load_recipe()) is None and settle_copy(moved, moved.load_recipe()) is None
    assert moved.run_id() == parent and moved.home() == moved.path
    run_checkpoints(moved, moved.load_recipe()).claim()
    assert claim(moved.path / "checkpoints")["run_dir"] == str(moved.path)  # the claim follows
    # a copy whose original was deleted since is the run's one directory: moved, not copied
    c = RunDirectory(cp_a(moved.path, tmp_path / "c"))
    shutil.rmtree(moved.path)
    assert settle_copy(c, c.load_recipe()) is None and c.run_id() == parent


def test_a_copy_of_a_run_dir_from_before_vlmrun_recorded_its_place_is_known_by_its_claim(tmp_path):
    a = made_run(tmp_path / "a")
    data = json.loads(a.run_file.read_text())
    a.run_file.write_text(json.dumps({k: v for k, v in data.items() if k != "run_dir"}))  # as earlier vlmruns wrote it
    b = RunDirectory(cp_a(a.path, tmp_path / "b"))
    assert original_of(a, a.load_recipe()) is None and original_of(b, b.load_recipe()).path == a.path
    assert settle_copy(b, b.load_recipe()).from_run_dir == str(a.path)
