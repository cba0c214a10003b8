"""A checkpoint belongs to one run: its run id (given once to the run directory), recorded in every
manifest and in the folder's claim; a run never lists, loads or deletes another run's checkpoints, and a
folder that is another run's is refused naming checkpoint.dir and that run."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from vlmrun.checkpoint.owner import CLAIM, CheckpointOwner, ForeignCheckpoints
from vlmrun.checkpoint.store import CheckpointStore
from vlmrun.config.load import load_recipe
from vlmrun.run.directory import RUN_FILE, RunDirectory

ROOT = Path(__file__).resolve().parents[1]
FORMAT1 = ROOT / "tests" / "fixtures" / "format1-run" / "checkpoints" / "step_9"
A, B = CheckpointOwner("run-a", "/runs/a"), CheckpointOwner("run-b", "/runs/b")


def _save(store: CheckpointStore, step: int) -> Path:
    pending = store.begin(step)
    files = pending.write("controller", {"counters": {"step": step}})
    files |= {f: d for p in ("model", "optimizer") for f, d in pending.write(p, {"w": torch.ones(4)}).items()}
    return store.finish(pending, files, None)


def test_every_manifest_names_its_run_and_another_runs_store_never_counts_or_deletes_it(tmp_path):
    a = CheckpointStore(tmp_path, keep=2, owner=A)
    _save(a, 2)
    _save(a, 4)
    manifest = json.loads((tmp_path / "step_4" / "manifest.json").read_text())
    assert (manifest["run_id"], manifest["run_dir"]) == ("run-a", "/runs/a")
    b = CheckpointStore(tmp_path, keep=1, owner=B)
    with pytest.raises(
        ForeignCheckpoints, match="checkpoint.dir: .*holds step_.* of another run: /runs/a, run id run-a"
    ):
        b.check_owner()
    assert b.complete() == []  # even past the check (a bug elsewhere): nothing of A's is B's
    _save(b, 6)  # B's retention (keep 1) has only B's own checkpoint to count
    assert [s for s, _ in a.complete()] == [2, 4] and [s for s, _ in b.complete()] == [6]


def test_a_claimed_folder_refuses_every_other_run_and_takes_its_owner_back(tmp_path):
    a = CheckpointStore(tmp_path / "ck", keep=2, owner=A)
    assert a.claim() is True and a.claim() is False  # its own claim again: nothing to do
    b = CheckpointStore(tmp_path / "ck", keep=2, owner=B)
    for refused in (b.check_owner, b.claim, b.latest):
        with pytest.raises(ForeignCheckpoints, match="belongs to another run: /runs/a, run id run-a") as e:
            refused()
        assert e.value.field == "checkpoint.dir" and e.value.exit_code == 2
    b.release_claim()  # not B's to release
    assert json.loads((tmp_path / "ck" / CLAIM).read_text())["run_id"] == "run-a"
    a.release_claim()
    assert not (tmp_path / "ck" / CLAIM).exists() and b.claim() is True


def _claim(args: tuple[str, str]) -> str:
    folder, run = args
    try:
        CheckpointStore(Path(folder), keep=1, owner=CheckpointOwner(run, f"/runs/{run}")).claim()
    except ForeignCheckpoints as e:
        return f"refused: {e}"
    return "claimed"


def test_of_runs_claiming_one_folder_at_once_exactly_one_wins(tmp_path):
    runs = [f"run-{k}" for k in range(6)]
    with ProcessPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(_claim, [(str(tmp_path / "ck"), r) for r in runs]))
    winner = json.loads((tmp_path / "ck" / CLAIM).read_text())["run_id"]
    assert answers.count("claimed") == 1 and answers[runs.index(winner)] == "claimed"
    assert all(f"run id {winner}" in a for a in answers if a != "claimed")


def test_checkpoints_from_before_run_ids_are_refused_to_a_new_run_and_adopted_by_an_old_one(tmp_path):
    shutil.copytree(FORMAT1, tmp_path / "step_9")
    with pytest.raises(ForeignCheckpoints, match="step_9 of another run \\(written before vlmrun gave runs an id\\)"):
        CheckpointStore(tmp_path, keep=1, owner=A).claim()
    old = CheckpointOwner("run-old", "/runs/old", adopts_unnamed=True)
    found, _ = CheckpointStore(tmp_path, keep=1, owner=old).latest()
    assert found.step == 9


def test_an_unreadable_checkpoint_in_an_unclaimed_folder_is_nobodys_to_take(tmp_path):
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "manifest.json").write_text("{torn")
    with pytest.raises(ForeignCheckpoints, match="step_3, whose manifest cannot be read"):
        CheckpointStore(tmp_path, keep=1, owner=A).check_owner()


def test_a_run_directory_gets_its_id_once_and_keeps_it(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", [], base_dir=tmp_path)
    rd = RunDirectory(tmp_path / "run")
    drawn = rd.run_id()  # before the directory exists: the id `create` writes
    rd.create(recipe)
    assert RunDirectory(tmp_path / "run").run_id() == drawn and not drawn.adopted
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["run_id"] == drawn.value
    assert RunDirectory(tmp_path / "other").run_id() != drawn


def test_a_run_directory_from_before_run_ids_gets_one_id_however_many_ask_at_once(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "recipe.yaml").write_text("name: x\n")
    assert RunDirectory(old).run_id(assign=False).adopted and not (old / RUN_FILE).exists()  # a reader writes nothing
    ids: list = []
    threads = [threading.Thread(target=lambda: ids.append(RunDirectory(old).run_id())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and ids[0].adopted and RunDirectory(old).run_id() == ids[0]
