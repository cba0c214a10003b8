"""A damaged newest checkpoint never costs the final weights, and readers never trip on the run's
retention, with real runs through the CLI (local cluster).

The damaged checkpoint of a finished, a stopped and a running run: export and the store's reading
API (what an evaluation reads through) give the newest valid one and name the damaged one; a resume
moves it aside (kept, named in the attempt's skipped_checkpoints), trains the lost steps again to the
same numbers and saves that step again; every message about a checkpoint names one that verifies.
`vlmrun export` while the run saves at every step with `checkpoint.keep: 1` never fails, and a
checkpoint an export held past the run's retention goes once it is let go: `checkpoint.keep` holds.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from shared_runs import copy_run, submit_args
from vlmrun_cli import Launcher, rows_of, sealed, sets, vlmrun, wait_for

from vlmrun.checkpoint.read import verify
from vlmrun.checkpoint.store import run_checkpoints
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def copy_of(run: Path, tmp_path: Path) -> Path:
    return copy_run(run, tmp_path / "run")


def start_running(tmp_path: Path, run_data: list[str], *more: str) -> tuple[Path, Launcher]:
    """A run that keeps training while a test reads, damages and exports its checkpoints: one rank (the
    readers' side of the race is the same with two, and a rank trains on one CPU, not two, meanwhile),
    a constant LR, no validation, no loader worker, `more` on top."""
    run = tmp_path / "run"
    quick = ["parallel.dp=1", "train.val_samples=0", "data.num_workers=0", "train.lr_schedule=constant", *more]
    return run, Launcher(tmp_path, *submit_args(run, *run_data, *sets(*quick)), name="running")


def damage(checkpoint: Path) -> None:
    model = checkpoint / "policy" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))


def attempts(run: Path) -> list[dict]:
    return json.loads((run / "job.json").read_text())["attempts"]


def same_numbers(a: dict, b: dict) -> None:
    for key in ("loss", "grad_norm", "lr", "sample_ids", "consumed_samples"):
        assert a[key] == b[key], (a["step"], key, a[key], b[key])


def read_for_eval(run: Path) -> tuple[int, list[str]]:
    """What an evaluation reads: the store's reading API on the run (held while it reads)."""
    rd = RunDirectory(run)
    with run_checkpoints(rd, rd.load_recipe(), assign=False).reading() as (checkpoint, skipped):
        checkpoint.read("model")
        return checkpoint.step, skipped


def export(run: Path, out: Path) -> tuple[dict, str]:
    done = vlmrun("export", str(run), str(out), "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr


def test_a_damaged_final_checkpoint_of_a_finished_run_is_trained_again(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    damage(run / "checkpoints" / "step_4")
    step, skipped = read_for_eval(run)
    assert step == 2 and "step_4" in skipped[0]
    answer, err = export(run, tmp_path / "export-before")
    assert answer["step"] == 2 and "step_4" in answer["skipped"][0]
    assert "warning: skipped step_4" in err and "exported step 2" in err  # never an older step in silence

    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0 and "nothing to do" not in out.stdout + out.stderr, out.stderr[-3000:]
    last = attempts(run)[-1]
    assert last["state"] == "COMPLETED" and last["resumed_from"] == 2
    assert (
        "step_4" in last["skipped_checkpoints"][0]
        and "moved aside to damaged_step_4-" in last["skipped_checkpoints"][0]
    )
    assert sealed(run) == [2, 4] and verify(run / "checkpoints" / "step_4")  # the valid step 2 was kept
    assert len(list((run / "checkpoints").glob("damaged_step_4-*"))) == 1  # kept for inspection
    for step in (3, 4):
        same_numbers(rows_of(run, 0)[step], rows_of(run, 1)[step])
    answer, err = export(run, tmp_path / "export-after")
    assert answer["step"] == 4 and answer["skipped"] == [] and "warning" not in err
    assert read_for_eval(run) == (4, [])
    again = vlmrun("resume", str(run), "--wait")
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr


def test_damage_while_running_and_at_the_stop_costs_nothing(run_data, tmp_path):
    """Running: the newest checkpoint is damaged under a training run, readers pass it by and say so.
    Stopped: the stop's checkpoint verifies when the stop says it was written; damaged afterwards, the
    resume trains the lost steps again to the same numbers and ends with a valid final checkpoint.
    The run's LR is constant (after the warmup): the last resume ends two steps after the stop instead
    of running the long run out."""
    # long enough to outlast the reads and the export on a loaded machine: 200 steps once ran out first (~40 s);
    # a checkpoint every 6 steps, so a read outlasts the next save only on a badly loaded machine (every 2
    # steps of two ranks: a loaded CI machine saw a newer one sealed during each of the 5 reads); keep 4,
    # so the stop's checkpoint, damaged below, still has a valid one before it when one damaged here comes next
    long = ["train.max_steps=2000", "train.epochs=63", "checkpoint.save_period=6", "checkpoint.keep=4"]
    run, launcher = start_running(tmp_path, run_data, *long)
    try:  # two checkpoints: the newest damaged, the one before it valid
        wait_for(lambda: 12 in sealed(run) or launcher.proc.poll() is not None, 300, "a checkpoint at step 12")
        assert 12 in sealed(run), "the run never saved step 12"
        for _ in range(5):  # damage the newest, and read before the run saves a newer one
            newest = sealed(run)[-1]
            damage(run / "checkpoints" / f"step_{newest}")
            step, skipped = read_for_eval(run)
            if sealed(run)[-1] == newest:
                break
        assert step < newest and f"skipped step_{newest}: " in skipped[0], (step, newest, skipped)
        answer, _ = export(run, tmp_path / "export-running")
        assert answer["step"] != newest
        assert launcher.proc.poll() is None, "the run ended before it could be stopped"
        os.killpg(launcher.pid, signal.SIGUSR2)
        assert launcher.wait(300) == 3  # stopped at a checkpoint
    finally:
        launcher.kill_group()
    stop = attempts(run)[-1]
    stopped_at = int(re.search(r"checkpointed at step (\d+)", stop["reason"]).group(1))
    assert stop["state"] == "STOPPED" and stop["last_step"] == stopped_at
    verify(run / "checkpoints" / f"step_{stopped_at}")  # the checkpoint the stop names exists and verifies

    damage(run / "checkpoints" / f"step_{stopped_at}")
    end = stopped_at + 2
    out = vlmrun("resume", str(run), "--wait", *sets(f"train.max_steps={end}"))
    assert out.returncode == 0, out.stderr[-3000:]
    last = attempts(run)[-1]
    assert last["state"] == "COMPLETED" and last["resumed_from"] < stopped_at
    assert f"moved aside to damaged_step_{stopped_at}-" in last["skipped_checkpoints"][0]
    verify(run / "checkpoints" / f"step_{end}")
    stopped_rows, resumed_rows = rows_of(run, len(attempts(run)) - 2), rows_of(run, len(attempts(run)) - 1)
    for step in range(last["resumed_from"] + 1, stopped_at + 1):  # trained twice, the same both times
        same_numbers(stopped_rows[step], resumed_rows[step])


def test_export_while_the_run_saves_every_step_with_keep_1(run_data, tmp_path):
    every_step = ["train.max_steps=400", "train.epochs=20", "checkpoint.save_period=1", "checkpoint.keep=1"]
    run, launcher = start_running(tmp_path, run_data, *every_step)
    exported = []
    try:
        wait_for(
            lambda: max(history(run / "metrics.jsonl"), default=0) >= 6 or launcher.proc.poll() is not None,
            300,
            "step 6",
        )
        for k in range(2):  # each one races the run's save and deletion of the checkpoint it reads
            answer, _ = export(run, tmp_path / f"export-{k}")
            exported.append(answer["step"])
        assert launcher.proc.poll() is None, "the run ended before the exports did"
    finally:
        launcher.kill_group()
        launcher.proc.wait()
    assert exported == sorted(exported) and exported[-1] > exported[0]  # the run saved (and deleted) meanwhile


def test_a_checkpoint_held_past_the_runs_end_goes_once_let_go(finished_run, tmp_path):
    """An export (the store's reading API, as `vlmrun export` holds it) holds step 2 while a resume
    trains to step 6 with keep 2: step 2 outlives the run while held, and goes when let go."""
    run = copy_of(finished_run, tmp_path)
    rd = RunDirectory(run)
    with run_checkpoints(rd, rd.load_recipe(), assign=False).reading(2) as (held, _):
        done = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait")
        assert done.returncode == 0, done.stderr[-3000:]
        assert held.step == 2 and sealed(run) == [2, 4, 6]
    assert sealed(run) == [4, 6]
