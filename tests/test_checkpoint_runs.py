"""A checkpoint belongs to one run and to what defined it, with real runs through the CLI (local cluster).

Two submits at once onto one `checkpoint.dir`: one runs, the other is refused (exit 2, naming
checkpoint.dir and the run that has it); later submits, dry runs and a job started on that folder by
another run are refused too, and the run keeps every checkpoint. Replacing what `model.path` holds
(same path, other weights) is refused on resume and by the job (`model.path contents: old -> new`,
with every other changed field); a copy of the same weights is not. A copied run directory (`cp -a`)
never touches the original's checkpoints: on the original's checkpoint.dir it is refused, with a folder
of its own it goes on as a fork; a moved one (`mv`) goes on as the same run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vlmrun_cli import ENV, ROOT, TINY, node, refused, sealed, sets, vlmrun

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FORMAT1 = ROOT / "tests" / "fixtures" / "format1-run" / "checkpoints" / "step_9"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_id(run: Path) -> str:
    return json.loads((run / "run.json").read_text())["run_id"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dirs) -> dict[str, Path]:
    """Tiny models of seeds 0 and 1, and `path`: the model directory the runs name (seed 0's files)."""
    from vlmrun.models.tiny import ensure_tiny_model

    base = tmp_path_factory.mktemp("models")
    seeds = {"seed0": Path(tiny_dirs["qwen2_5_vl"]), "seed1": ensure_tiny_model("qwen2_5_vl", base / "cache", seed=1)}
    shutil.copytree(seeds["seed0"], base / "model")
    return seeds | {"path": base / "model"}


@pytest.fixture(scope="module")
def race(tmp_path_factory, run_data, models) -> dict:
    """Two submits started at once onto one checkpoint.dir, each of a tiny run of 4 steps (checkpoints 2, 4)."""
    base = tmp_path_factory.mktemp("race")
    folder = base / "shared-checkpoints"
    args = [
        *run_data,
        *sets("train.max_steps=4", "checkpoint.save_period=2", "train.val_samples=0", "data.num_workers=0"),
        "--set",
        "parallel.dp=1",  # one rank: the claim on the folder is the controller's
        *sets(f"checkpoint.dir={folder}", f"model.path={models['path']}", "model.tiny=false"),
    ]
    runs = [base / "run-a", base / "run-b"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "vlmrun.cli", "submit", TINY, "--cluster", "local", "--run-dir", str(r), "--wait"]
            + args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        for r in runs
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, [err[-2000:] for _, err in outs])
    won = codes.index(0)
    return {
        "folder": folder,
        "sets": args,
        "winner": runs[won],
        "loser": runs[1 - won],
        "loser_err": outs[1 - won][1],
    }


def test_of_two_submits_at_once_onto_one_checkpoint_dir_one_runs_and_the_other_is_refused(race):
    winner, folder = race["winner"], race["folder"]
    err = race["loser_err"]
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert "checkpoint.dir" in err and str(winner) in err and run_id(winner) in err, err
    assert not race["loser"].exists()  # refused before its run directory was made
    assert json.loads((winner / "job.json").read_text())["state"] == "COMPLETED"
    steps = sorted(p.name for p in folder.glob("step_*"))
    assert steps == ["step_2", "step_4"]
    for step in steps:
        assert json.loads((folder / step / "manifest.json").read_text())["run_id"] == run_id(winner)
    assert json.loads((folder / "owner.json").read_text())["run_id"] == run_id(winner)


def test_a_later_submit_or_dry_run_onto_that_checkpoint_dir_is_refused_and_nothing_changes(race, tmp_path):
    before = snapshot(race["folder"])
    for extra in (["--dry-run"], ["--cluster", "local", "--run-dir", str(tmp_path / "late"), "--wait"]):
        out = vlmrun("submit", TINY, *extra, *race["sets"], timeout=120)
        refused(out, "checkpoint.dir", str(race["winner"]), run_id(race["winner"]))
    assert not (tmp_path / "late").exists()
    assert snapshot(race["folder"]) == before
    # checkpoints from before run ids are nobody's to take either
    shutil.copytree(FORMAT1, tmp_path / "old-checkpoints" / "step_9")
    out = vlmrun("submit", TINY, "--dry-run", "--set", f"checkpoint.dir={tmp_path / 'old-checkpoints'}", timeout=120)
    refused(out, "checkpoint.dir", "step_9", "before vlmrun gave runs an id")


def test_export_reads_only_the_runs_own_checkpoints(race, tmp_path):
    out = vlmrun("export", str(race["winner"]), str(tmp_path / "export"), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["step"] == 4
    record = json.loads((tmp_path / "export" / "vlmrun_export.json").read_text())
    assert record["run_dir"] == str(race["winner"]) and record["step"] == 4


def test_a_job_of_another_run_on_that_checkpoint_dir_fails_before_it_reads_anything(race, tmp_path):
    """A run that got past submit (here: a copy of the winner given a run id of its own) meets the claim
    again when its job starts: FAILED, exit 2, naming checkpoint.dir and the run that has the folder."""
    other = tmp_path / "other"
    shutil.copytree(race["winner"], other, ignore=shutil.ignore_patterns("cache", "lock*"))
    (other / "run.json").write_text(json.dumps({"run_id": "another-run", "created": "now", "adopted": False}))
    before = snapshot(race["folder"])
    out = node(other)
    assert out.returncode == 2, out.stderr[-3000:]
    attempt = json.loads((other / "job.json").read_text())["attempts"][-1]
    assert attempt["state"] == "FAILED" and "checkpoint.dir" in attempt["reason"]
    assert str(race["winner"]) in attempt["reason"]
    assert snapshot(race["folder"]) == before


def test_other_weights_at_the_same_model_path_are_refused_on_resume_and_by_the_job(race, models, tmp_path):
    """On resume, before anything starts; and by the job, against the checkpoint it verified (a copy of
    the run with a copy of its checkpoint folder, which goes on as a fork of it), where an edited
    recipe.yaml is named too: every changed field."""
    from vlmrun.launch.resume import check_resumable
    from vlmrun.run.directory import RunDirectory

    winner, path = race["winner"], models["path"]
    job_before = (winner / "job.json").read_text()
    try:
        shutil.rmtree(path)
        shutil.copytree(models["seed1"], path)  # same path, other weights
        out = vlmrun("resume", str(winner), "--set", "train.max_steps=6", "--wait", timeout=120)
        refused(out, "model.path contents: '", "' -> '")
        assert (winner / "job.json").read_text() == job_before
        twin = tmp_path / "twin"
        shutil.copytree(winner, twin, ignore=shutil.ignore_patterns("cache", "lock*"))
        own = shutil.copytree(race["folder"], tmp_path / "twin-checkpoints")  # the original's is not the copy's
        recipe = (twin / "recipe.yaml").read_text().replace(str(race["folder"]), str(own))
        edited = recipe.replace("max_steps: 4", "max_steps: 6").replace("micro_batch_size: 2", "micro_batch_size: 4")
        (twin / "recipe.yaml").write_text(edited)
        job = node(twin)
        assert job.returncode == 2, job.stderr[-3000:]
        attempt = json.loads((twin / "job.json").read_text())["attempts"][-1]
        assert attempt["state"] == "FAILED" and "model.path contents: '" in attempt["reason"]
        assert "train.micro_batch_size: 2 -> 4" in attempt["reason"], attempt["reason"]
        rows = [json.loads(line) for line in (twin / "metrics.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in rows) == 4  # it trained nothing
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(models["seed0"], path, copy_function=shutil.copyfile)  # the same weights, new mtimes
    rd = RunDirectory(winner)
    check_resumable(rd, rd.load_recipe())  # a copy of the same weights resumes


def cp_a(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_a_copied_run_dir_on_the_originals_checkpoint_dir_is_refused_until_it_has_a_folder_of_its_own(race, tmp_path):
    """`cp -a` of a run with an explicit checkpoint.dir: resuming the copy is refused (exit 2, naming the
    folder, the original and how to go on), and so is its job; given a copy of the folder, it trains on
    as a fork of its own. The original's folder and record never change."""
    winner, folder = race["winner"], race["folder"]
    before, job_before = snapshot(folder), (winner / "job.json").read_text()
    copy = cp_a(winner, tmp_path / "copy")
    out = vlmrun("resume", str(copy), "--set", "train.max_steps=6", "--wait", timeout=300)
    refused(out, "checkpoint.dir", str(folder), str(winner), f"vlmrun resume {copy} --set checkpoint.dir=")
    job = node(copy)  # the job of the copy, as SLURM would start it
    assert job.returncode == 2, job.stderr[-3000:]
    attempt = json.loads((copy / "job.json").read_text())["attempts"][-1]
    assert attempt["state"] == "FAILED" and "checkpoint.dir" in attempt["reason"] and "a copy" in attempt["reason"]
    assert snapshot(folder) == before

    mine = cp_a(folder, tmp_path / "copy-checkpoints")
    out = vlmrun("resume", str(copy), "--set", f"checkpoint.dir={mine}", "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    assert snapshot(folder) == before and (winner / "job.json").read_text() == job_before
    forks = json.loads((copy / "job.json").read_text())["forks"]
    assert [(f["from_run_id"], f["from_run_dir"], f["run_id"]) for f in forks] == [
        (run_id(winner), str(winner), run_id(copy))
    ]
    assert sorted(p.name for p in mine.glob("step_*")) == ["step_4", "step_6"]
    assert json.loads((mine / "step_6" / "manifest.json").read_text())["run_id"] == run_id(copy) != run_id(winner)
    assert sorted(history(copy / "metrics.jsonl")) == list(range(1, 7))
    assert sorted(history(winner / "metrics.jsonl")) == list(range(1, 5))


def test_a_copied_run_dir_goes_on_as_a_fork_and_a_moved_one_as_the_same_run(finished_run, tmp_path):
    """A copy of a run whose checkpoints are inside it forks (its own run id, the copied checkpoints its
    own); moved afterwards (mv), it goes on as the same run."""
    before = snapshot(finished_run / "checkpoints") | {"job.json": (finished_run / "job.json").read_bytes()}
    copy = cp_a(finished_run, tmp_path / "copy")
    out = vlmrun("resume", str(copy), "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    forked = run_id(copy)
    assert forked != run_id(finished_run) and json.loads((copy / "run.json").read_text())["run_dir"] == str(copy)
    assert sealed(copy) == [4, 6] and sealed(finished_run) == [2, 4]
    assert snapshot(finished_run / "checkpoints") | {"job.json": (finished_run / "job.json").read_bytes()} == before
    moved = Path(shutil.move(copy, tmp_path / "moved"))
    out = vlmrun("resume", str(moved), "--set", "train.max_steps=8", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    assert run_id(moved) == forked and len(json.loads((moved / "job.json").read_text())["forks"]) == 1
    assert sealed(moved) == [6, 8] and sorted(history(moved / "metrics.jsonl")) == list(range(1, 9))


@pytest.mark.slurm
def test_a_slurm_submit_refused_after_the_claim_leaves_neither_the_claim_nor_the_folder(tmp_path):
    """The claim on an explicit checkpoint.dir is taken before the SLURM checks; when those refuse the
    run (here: more CPUs than a node has), the claim and the folder it made go again."""
    folder = tmp_path / "checkpoints"
    run = tmp_path / "run"
    args = ["--cluster", "slurm", "--run-dir", str(run), "--set", f"checkpoint.dir={folder}"]
    out = vlmrun("submit", TINY, *args, "--set", "cluster.cpus_per_node=999", timeout=120)
    refused(out, "cluster.cpus_per_node")
    assert not folder.exists() and not run.exists()
