"""Resume and late-found problems, as a user meets them through the CLI, with real runs (local cluster).

A resume compares what defines the run against its checkpoint whatever changed it (`--set` or an
edited recipe.yaml) and refuses with `field: old -> new`, exit 2, writing nothing (that the job checks
again against the checkpoint it verified: test_checkpoint_runs.py). A completed run with nothing left
says so and exits 0 without starting anything. A data set too small for the layout is refused at
submit, not inside the job. The runs resumed here are copies of the session's `finished_run`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from shared_runs import copy_run
from vlmrun_cli import TINY, Launcher, census, job, node_pid, reaper_of, refused, rows, sets, vlmrun, wait_for

pytestmark = pytest.mark.slow


def copy_of(run: Path, tmp_path: Path) -> Path:
    return copy_run(run, tmp_path / "run")


def edit_recipe(run: Path, section: str, key: str, value) -> None:
    raw = yaml.safe_load((run / "recipe.yaml").read_text())
    raw[section][key] = value
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def test_resuming_a_completed_run_says_so_and_starts_nothing(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    before = (run / "job.json").read_text()
    t0 = time.monotonic()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr
    assert "nothing to do" in out.stdout + out.stderr
    assert time.monotonic() - t0 < 20  # no Ray was started
    assert (run / "job.json").read_text() == before  # no empty attempt recorded


@pytest.mark.parametrize(
    "section, key, value, field",
    [
        ("train", "global_batch_size", 16, "train.global_batch_size: 8 -> 16"),
        ("train", "seed", 7, "train.seed: 1234 -> 7"),
        ("train", "loop", "v1", "train.loop: 'v2' -> 'v1'"),
        ("data", "max_seq_len", 128, "data.max_seq_len: 256 -> 128"),
        ("data", "split", "val", "data.split: 'train' -> 'val'"),
        ("parallel", "dp", 1, "parallel.dp: 2 -> 1"),
        ("model", "dtype", "bfloat16", "model.dtype: 'float32' -> 'bfloat16'"),
    ],
)
def test_an_edited_recipe_yaml_that_changes_the_run_is_refused_naming_old_and_new(
    finished_run, tmp_path, section, key, value, field
):
    run = copy_of(finished_run, tmp_path)
    edit_recipe(run, section, key, value)
    before = (run / "job.json").read_text()
    out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait", timeout=60)
    refused(out, field)
    assert (run / "job.json").read_text() == before


@pytest.mark.parametrize("override", ["train.loop=v1", "train.global_batch_size=16", "parallel.dp=1", "train.seed=1"])
def test_a_set_that_changes_the_run_is_refused(finished_run, tmp_path, override):
    run = copy_of(finished_run, tmp_path)
    out = vlmrun("resume", str(run), "--set", override, "--set", "train.max_steps=6", timeout=60)
    refused(out, override.split("=")[0])


#: What the docs call outside the run's identity (memory only, a submit-time check) or a recovery step.
SAFE_TO_CHANGE = [
    *("data.on_bad_sample=drop", "data.error_tolerance=64", "data.check_at_submit=false"),
    *("generation.refit_bucket_mb=64", "generation.release_weights=true"),
]


def test_a_resume_accepts_the_settings_documented_as_safe_to_change(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    out = vlmrun("resume", str(run), *sets(*SAFE_TO_CHANGE), timeout=60)
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr[-3000:]  # accepted; it had completed


def test_a_resume_at_another_loader_worker_count_is_refused_saying_why(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    before = (run / "job.json").read_text()
    out = vlmrun("resume", str(run), "--set", "data.num_workers=2", "--set", "train.max_steps=6", timeout=60)
    refused(out, "data.num_workers", "another sample order", "restores only at the count it was saved with")
    assert (run / "job.json").read_text() == before


def test_a_data_set_too_small_for_the_layout_is_refused_at_submit(tmp_path):
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"data.path={tmp_path / 'one'}",
        "--set",
        "data.synthetic={train: 1, val: 8, image_size: 64, seed: 0}",
        timeout=60,
    )
    refused(out, "data.path", "parallel.dp")
    assert not (tmp_path / "run").exists() and not (tmp_path / "one").exists()
    dry = vlmrun(
        "submit",
        TINY,
        "--dry-run",
        "--set",
        f"data.path={tmp_path / 'one'}",
        "--set",
        "data.synthetic={train: 1, val: 8, image_size: 64, seed: 0}",
        timeout=60,
    )
    refused(dry, "data.path")


def test_an_unwritable_checkpoint_dir_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for extra in ([], ["--dry-run"]):
        out = vlmrun(
            "submit",
            TINY,
            "--cluster",
            "local",
            "--run-dir",
            str(tmp_path / "run"),
            *extra,
            "--set",
            f"checkpoint.dir={blocker / 'ckpt'}",
            timeout=60,
        )
        refused(out, "checkpoint.dir")
    assert not (tmp_path / "run").exists()


def test_with_every_checkpoint_invalid_it_says_so_trains_from_0_and_a_dead_rank_fails_it_in_one_line(
    finished_run, tmp_path
):
    """Every checkpoint damaged: the console (the node's own line, not Ray's) and job.json say so and the
    attempt trains from step 0. Then a rank actor SIGKILLed mid-run: FAILED, one line naming the cause
    and where, the log's path."""
    run = copy_of(finished_run, tmp_path)
    for step_dir in (run / "checkpoints").glob("step_*"):
        model = step_dir / "policy" / "model.pt"
        model.write_bytes(b"x" + model.read_bytes()[1:])
    launcher = Launcher(tmp_path, "resume", str(run), "--wait", *sets("train.max_steps=400", "train.epochs=20"))
    marker, _, _ = reaper_of(node_pid(run))
    wait_for(lambda: len([r for r in rows(run) if r["attempt"] == 1]) >= 6, 240, "6 steps of the resumed attempt")
    assert sorted(r["step"] for r in rows(run) if r["attempt"] == 1)[:6] == [1, 2, 3, 4, 5, 6]
    attempt = job(run)["attempts"][-1]
    assert "no valid checkpoint left" in attempt["notice"] and "training from step 0" in attempt["notice"]
    victim = next(pid for pid, name in census(marker).items() if name.startswith("ray::SftWorker"))
    os.kill(victim, signal.SIGKILL)
    code, err = launcher.wait(240), launcher.stderr()
    plain = [line for line in err.splitlines() if "no valid checkpoint left" in line]
    assert plain and not plain[0].startswith("("), err[-3000:]  # the node's own line, not Ray's
    assert code == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if "FAILED:" in line]
    assert len(failed) == 1 and "\x1b" not in failed[0] and "traceback in" in failed[0], err[-3000:]
    reason = job(run)["attempts"][-1]["reason"]
    assert job(run)["attempts"][-1]["state"] == "FAILED" and "\n" not in reason and "\x1b" not in reason
    assert "Actor" in reason or "actor" in reason, reason
