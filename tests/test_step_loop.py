"""The step loop (algorithms/common/loop.py) in-process: its ranks stood in for by one object, its
checkpoints, metrics log and recipe real. What it promises every algorithm: the rows and checkpoints of
a run, a resume that continues the numbers of an uninterrupted run (counters, RNG, the ranks' state),
a stop acted on at the step boundary, a damaged newest checkpoint saved again, a checkpoint of another
run definition or layout refused, validation rows, and no write once the node process is gone.
The same promises on real runs: tests/test_chaos_processes.py, test_checkpoint_damage.py."""

from __future__ import annotations

import gc
import logging
import os
import random
from pathlib import Path

import pytest
import torch
from vlmrun_cli import TINY

from vlmrun.algorithms.common.loop import DriverLost, StepLoop
from vlmrun.algorithms.common.validation import ValidationScore, ValidationSet
from vlmrun.checkpoint.parts import PolicyState, Storage
from vlmrun.checkpoint.store import run_checkpoints
from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.run.directory import RunDirectory, dump_recipe
from vlmrun.run.lock import Holder
from vlmrun.run.metrics import history
from vlmrun.run.rows import StepRow
from vlmrun.run.state import State


@pytest.fixture(autouse=True)
def _unfreeze():
    yield
    gc.unfreeze()  # the loop freezes the heap once set up: give this process's back to the collector


class Ranks:
    """The worker group as the loop sees it, its ranks in this process. The ranks hold one weight that
    each step moves; they save and load it as the policy's part, and their RNG as theirs."""

    def __init__(self, world_size: int = 2, score: ValidationScore | None = None, val: ValidationSet | None = None):
        self.world_size, self.weight, self.calls, self.loaded = world_size, torch.zeros(1), [], None
        self.score = score or ValidationScore(nll=3.0, tokens=6, correct=1, answered=2)
        self.val = val  # rank 0's val set: every rank's share (here a name for it), the answers, the samples left out
        self.writes: dict = {}  # rank -> its background policy write (checkpoint.async_save)

    def all_ranks(self, method: str, *args, **kwargs) -> list:
        self.calls.append(method)
        return [getattr(self, f"_{method}")(rank, *args, **kwargs) for rank in range(self.world_size)]

    def on_rank(self, rank: int, method: str, **kwargs):
        self.calls.append(method)
        return getattr(self, f"_{method}")(rank, **kwargs)

    def per_rank(self, method: str, kwargs_of) -> list:
        self.calls.append(method)
        return [getattr(self, f"_{method}")(rank, **kwargs_of(rank)) for rank in range(self.world_size)]

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def _save(self, rank, pending, background=False):
        state = PolicyState(Storage.REPLICATED, {"model": {"w": self.weight}, "optimizer": {}})  # the live tensor
        if background:
            self.writes[rank] = pending.start_policy_write(state, rank=rank)
            written = {}
        else:
            written = pending.write_policy(state, rank=rank)
        return written | pending.write("rng", {"rank": rank}, index=rank)

    def _save_done(self, rank, wait=False):
        write = self.writes.get(rank)
        if write is None:
            return {}
        return write.result() if wait or write.done() else None

    def _load(self, rank, found, restart_data=False):
        self.weight = found.read("model")["w"].clone()
        self.loaded = (found.step, restart_data)

    def _freeze_heap(self, rank):
        pass

    def _load_model_weights(self, rank):
        self.weight = torch.zeros(1)  # what a cold start's ranks hold

    def _val_set(self, rank, **how):
        return self.val

    def _validate(self, rank, share):
        self.calls.append(("share", rank, share))
        return self.score


class Loop(StepLoop):
    """A step loop whose step moves the ranks' weight by a draw of the controller's RNG (so a resume
    that lost the RNG, the counters or the weight shows in the numbers); `stop_at`: request a stop
    during that step; `lost_at`: the node process is gone from that step on."""

    stop_at = lost_at = None
    ranks: Ranks | None = None

    def _start(self, found):
        self.group = self.ranks or Ranks()
        self.started_from = found

    def _train_step(self, step: int, counters: dict) -> StepRow:
        if step == self.stop_at:
            self.request_stop("SIGUSR2")
        if step == self.lost_at:
            self.driver = Holder(pid=2**22 + 1, host=os.uname().nodename, job_id="gone")  # no such process
        self.group.weight += random.random()
        counters["consumed_samples"] += 8
        return StepRow(
            step=step,
            attempt=self.attempt,
            epoch=self.steps.epoch_of(step),
            loss=float(self.group.weight),
            grad_norm=1.0,
            lr=0.1,
            valid_tokens=10,
            consumed_samples=counters["consumed_samples"],
            sample_ids=[f"s{step}"],
            step_time_s=0.01,
            loader_latency_max_s=0.0,
            tokens_per_s=1.0,
            samples_per_s=1.0,
            peak_rss_mb=1.0,
        )

    def _ray_alive_nodes(self) -> int:
        return 1


def make_run(path: Path, clevr_set: Path, *overrides: str) -> RunDirectory:
    recipe = load_recipe(
        TINY,
        [
            *(f"data.path={clevr_set}", "data.synthetic=null", "train.max_steps=6", "checkpoint.save_period=2"),
            *("train.val_samples=0", "logger.wandb_mode=disabled", *overrides),
        ],
    )
    rd = RunDirectory(path)
    rd.create(recipe)
    return rd


def run_loop(rd: RunDirectory, attempt: int = 0, **attrs) -> tuple[Loop, object]:
    recipe = rd.load_recipe()
    loop = Loop(recipe_json=recipe.model_dump_json(), run_dir=str(rd.path), attempt=attempt, model_dir="/unused")
    for name, value in attrs.items():
        setattr(loop, name, value)
    return loop, loop.run()


def losses(rd: RunDirectory) -> dict[int, float]:
    return {step: row["loss"] for step, row in history(rd.metrics_file()).items()}


def sealed_steps(rd: RunDirectory) -> list[int]:
    return [step for step, _ in run_checkpoints(rd, rd.load_recipe(), assign=False).complete()]


def test_a_run_writes_a_row_per_step_and_checkpoints_by_period_keeping_the_newest(tmp_path, clevr_set):
    rd = make_run(tmp_path / "run", clevr_set)
    loop, outcome = run_loop(rd)
    assert (outcome.state, outcome.last_step, outcome.max_steps) == (State.COMPLETED, 6, 6)
    assert outcome.reason == "finished at step 6 of 6; 6 step(s) in this attempt" and outcome.stop_signal is None
    rows = history(rd.metrics_file())
    assert sorted(rows) == [1, 2, 3, 4, 5, 6] and rows[6]["consumed_samples"] == 48
    assert sealed_steps(rd) == [4, 6]  # every 2 steps and the last, keep=2
    assert len(outcome.checkpoint_save_s) == 3 and outcome.ray_alive_nodes == 1
    assert loop.group.calls == ["freeze_heap", *["save"] * 3, "shutdown"] and loop.started_from is None


def test_a_run_that_its_epochs_end_says_so_where_it_finishes(tmp_path, clevr_set):
    """train.epochs: 1 over 96 samples, 8 a step: 12 steps, and the finish line says what cut train.max_steps."""
    rd = make_run(tmp_path / "run", clevr_set, "train.max_steps=20", "checkpoint.save_period=0")
    _, outcome = run_loop(rd)
    assert (outcome.state, outcome.last_step, outcome.max_steps) == (State.COMPLETED, 12, 12)
    assert outcome.reason == (
        "finished at step 12 of 12 (train.epochs: 1 caps train.max_steps=20); 12 step(s) in this attempt"
    )


def test_a_resume_continues_the_numbers_of_the_uninterrupted_run(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "stopped", clevr_set)
    _, first = run_loop(rd, stop_at=4)  # stopped in step 4: checkpointed at 4
    loop, outcome = run_loop(rd, attempt=1)
    assert loop.started_from.step == 4 and loop.group.loaded == (4, False)
    assert outcome.state is State.COMPLETED and outcome.resumed_from == 4
    assert outcome.reason == "finished at step 6 of 6; 2 step(s) in this attempt, resumed at step 4"
    assert losses(rd) == losses(straight)  # the controller's RNG, counters and the ranks' weight came back
    assert history(rd.metrics_file())[6]["consumed_samples"] == 48 and history(rd.metrics_file())[6]["attempt"] == 1


@pytest.mark.parametrize("stop_at, stopped_at", [(3, 3), (1, 1)])
def test_a_stop_is_acted_on_at_the_step_boundary_with_a_checkpoint(tmp_path, clevr_set, stop_at, stopped_at):
    rd = make_run(tmp_path / "run", clevr_set, "checkpoint.save_period=0")
    loop, outcome = run_loop(rd, stop_at=stop_at)
    assert (outcome.state, outcome.last_step, outcome.stop_signal) == (State.STOPPED, stopped_at, "SIGUSR2")
    assert outcome.reason == f"stop requested (SIGUSR2); checkpointed at step {stopped_at}"
    assert sorted(history(rd.metrics_file())) == list(range(1, stopped_at + 1))  # nothing after the step in flight
    assert sealed_steps(rd) == [stopped_at] and loop.group.calls.count("save") == 1  # saved once


def test_train_stop_after_stops_there_checkpointed_and_a_run_on_equals_the_straight_run(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "run", clevr_set, "train.stop_after=3")
    loop, outcome = run_loop(rd)
    assert (outcome.state, outcome.last_step, outcome.stop_signal) == (State.STOPPED, 3, None)  # not requeued
    assert outcome.reason == "stop requested (train.stop_after: 3); checkpointed at step 3"
    assert sorted(history(rd.metrics_file())) == [1, 2, 3] and sealed_steps(rd) == [2, 3]
    _, again = run_loop(rd, attempt=1)  # the same stop point: already passed, so it stops at once
    assert (again.state, again.last_step) == (State.STOPPED, 3) and sorted(history(rd.metrics_file())) == [1, 2, 3]
    recipe = rd.load_recipe()
    recipe.train.stop_after = None  # what `vlmrun resume` does unless it is given the field again
    rd.recipe_file.write_text(dump_recipe(recipe))
    _, outcome = run_loop(rd, attempt=2)
    assert outcome.state is State.COMPLETED and losses(rd) == losses(straight)


def test_a_stop_before_the_first_step_checkpoints_nothing(tmp_path, clevr_set):
    rd = make_run(tmp_path / "run", clevr_set)
    recipe = rd.load_recipe()
    loop = Loop(recipe_json=recipe.model_dump_json(), run_dir=str(rd.path), attempt=0, model_dir="/unused")
    loop.request_stop("SIGTERM")
    outcome = loop.run()
    assert (outcome.state, outcome.last_step, outcome.stop_signal) == (State.STOPPED, 0, "SIGTERM")
    assert not rd.metrics_file().exists() and sealed_steps(rd) == [] and "save" not in loop.group.calls


def test_a_damaged_newest_checkpoint_is_set_aside_and_its_step_saved_again(tmp_path, clevr_set):
    rd = make_run(tmp_path / "run", clevr_set)
    run_loop(rd)
    want = losses(rd)
    model = rd.path / "checkpoints" / "step_6" / "policy" / "model.pt"
    model.write_bytes(model.read_bytes()[:-1] + b"x")
    loop, outcome = run_loop(rd, attempt=1)
    assert loop.started_from.step == 4 and outcome.resumed_from == 4
    assert "step_6" in outcome.skipped_checkpoints[0] and "moved aside" in outcome.skipped_checkpoints[0]
    assert sealed_steps(rd) == [4, 6] and len(list((rd.path / "checkpoints").glob("damaged_step_6-*"))) == 1
    assert losses(rd) == want  # steps 5 and 6 trained again to the same numbers


@pytest.mark.parametrize(
    "change, words",
    [
        ("train.micro_batch_size=4", "train.micro_batch_size: 2 -> 4"),
        ("train.seed=7", "train.seed: 1234 -> 7"),
    ],
)
def test_a_checkpoint_of_another_run_definition_is_refused_before_any_rank_starts(tmp_path, clevr_set, change, words):
    rd = make_run(tmp_path / "run", clevr_set)
    run_loop(rd)
    recipe = load_recipe(rd.recipe_file, [change, "train.max_steps=8"])
    loop = Loop(recipe_json=recipe.model_dump_json(), run_dir=str(rd.path), attempt=1, model_dir="/unused")
    with pytest.raises(InputError, match=words) as e:
        loop.run()
    assert e.value.exit_code == 2 and not hasattr(loop, "group")  # refused before any worker started
    assert max(history(rd.metrics_file())) == 6


def test_a_checkpoint_of_another_layout_needs_restart_data_order(tmp_path, clevr_set):
    rd = make_run(tmp_path / "run", clevr_set, "train.global_batch_size=4")
    run_loop(rd)
    other = load_recipe(rd.recipe_file, ["parallel.dp=1", "train.max_steps=8"])
    loop = Loop(recipe_json=other.model_dump_json(), run_dir=str(rd.path), attempt=1, model_dir="/unused")
    with pytest.raises(InputError, match="parallel.dp: 2 -> 1"):
        loop.run()
    restart = load_recipe(rd.recipe_file, ["parallel.dp=1", "train.max_steps=8", "checkpoint.restart_data_order=true"])
    loop = Loop(recipe_json=restart.model_dump_json(), run_dir=str(rd.path), attempt=1, model_dir="/unused")
    outcome = loop.run()
    assert loop.group.loaded == (6, True) and outcome.resumed_from == 6
    assert "data order starts over" in outcome.restarted_data_order and "dp=2" in outcome.restarted_data_order


def test_validation_steps_carry_the_summed_score_and_an_empty_pass_says_so(tmp_path, clevr_set, caplog):
    caplog.set_level(logging.WARNING, logger="vlmrun")
    rd = make_run(tmp_path / "run", clevr_set, "train.val_samples=2", "train.val_period=3")
    loop, outcome = run_loop(rd, ranks=Ranks(val=ValidationSet(["share-0", "share-1"], ["3", "4"], 1)))
    rows = history(rd.metrics_file())
    assert [s for s, r in rows.items() if "val_loss" in r] == [3, 6]  # every val_period and the last
    assert rows[3]["val_loss"] == 6.0 / 12 and rows[3]["val_accuracy"] == 2 / 4 and rows[3]["val_dropped_samples"] == 1
    assert outcome.final_val["val_samples"] == 4 and loop.group.calls.count("validate") == 2
    assert loop.group.calls.count("val_set") == 1  # read once, by rank 0
    assert [c for c in loop.group.calls if isinstance(c, tuple)] == [
        ("share", 0, "share-0"),
        ("share", 1, "share-1"),
    ] * 2
    assert rows[3]["val_majority_baseline"] == 0.5
    empty = make_run(tmp_path / "empty", clevr_set, "train.val_samples=2", "train.val_period=3")
    run_loop(
        empty, ranks=Ranks(score=ValidationScore(0.0, 0, 0, 2), val=ValidationSet(["share-0", "share-1"], ["3", "4"]))
    )
    assert history(empty.metrics_file())[3]["val_loss"] is None and history(empty.metrics_file())[3]["val_tokens"] == 0
    assert "scored no token of 2 val samples" in caplog.text


def test_the_sft_controllers_class_and_what_it_imports_load_no_torch():
    """The SFT controller's process holds no torch (common/loop.py, 5). A real run's controller, past a
    validation and checkpoints, and resumed: tests/test_chaos_processes.py (tests 1 and 3)."""
    import subprocess
    import sys

    code = "import sys; from vlmrun.algorithms.controllers import controller_class; controller_class('sft'); "
    code += "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-3000:]


def test_once_the_node_process_is_gone_nothing_more_is_written(tmp_path, clevr_set):
    rd = make_run(tmp_path / "run", clevr_set)
    with pytest.raises(DriverLost, match="this attempt writes nothing more"):
        run_loop(rd, lost_at=3)
    assert sorted(history(rd.metrics_file())) == [1, 2] and sealed_steps(rd) == [2]  # not step 3's row, nor more


def test_the_step_waits_for_the_writes_and_the_seal_runs_behind_the_next_steps(tmp_path, clevr_set, monkeypatch):
    """Step 2's checkpoint is sealed (fsync, manifest, rename) while step 3 trains: the seal waits here
    until step 3 has trained, which it never would if the loop sealed before stepping on."""
    import threading

    from vlmrun.checkpoint import store as checkpoint_store

    trained_3, seen = threading.Event(), {}
    finish = checkpoint_store.CheckpointStore.finish

    def behind(store, pending, files, meta):
        if pending.step == 2:
            seen["folder"], seen["step 3 trained meanwhile"] = Path(pending.path).name, trained_3.wait(30)
        return finish(store, pending, files, meta)

    class Stepping(Loop):
        def _train_step(self, step, counters):
            if step == 3:
                trained_3.set()
            return super()._train_step(step, counters)

    monkeypatch.setattr(checkpoint_store.CheckpointStore, "finish", behind)
    rd = make_run(tmp_path / "run", clevr_set)
    recipe = rd.load_recipe()
    outcome = Stepping(recipe_json=recipe.model_dump_json(), run_dir=str(rd.path), attempt=0, model_dir="/unused").run()
    assert seen == {"folder": "tmp_step_2", "step 3 trained meanwhile": True}
    assert outcome.state is State.COMPLETED and sealed_steps(rd) == [4, 6]  # keep 2
    assert len(outcome.checkpoint_save_s) == len(outcome.checkpoint_write_s) == 3
    assert all(w >= s for s, w in zip(outcome.checkpoint_save_s, outcome.checkpoint_write_s, strict=True))


def test_a_seal_that_fails_fails_the_run_at_the_next_step_and_publishes_nothing(tmp_path, clevr_set, monkeypatch):
    from vlmrun.checkpoint import store as checkpoint_store

    def full(store, pending, files, meta):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_store.CheckpointStore, "finish", full)
    rd = make_run(tmp_path / "run", clevr_set)
    with pytest.raises(OSError, match="No space left"):
        run_loop(rd)
    assert sealed_steps(rd) == [] and max(history(rd.metrics_file())) <= 3  # raised by the step after the save


# ---------------------------------------------------------------- checkpoint.async_save


@pytest.fixture
def held_writes(monkeypatch):
    """The background policy writes of the steps put in the returned set wait until the test ends."""
    from vlmrun.checkpoint import write as checkpoint

    held, release = set(), __import__("threading").Event()
    write_parts = checkpoint.PendingCheckpoint._write_parts

    def slow(pending, *how):
        if pending.step in held:
            release.wait(30)
        return write_parts(pending, *how)

    monkeypatch.setattr(checkpoint.PendingCheckpoint, "_write_parts", slow)
    yield held
    release.set()


def test_async_save_gives_the_checkpoints_and_numbers_of_sync_saves(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "async", clevr_set, "checkpoint.async_save=true")
    loop, outcome = run_loop(rd, stop_at=4)  # the weight changes in place after each save began: copied first
    _, outcome = run_loop(rd, attempt=1)
    assert outcome.state is State.COMPLETED and outcome.resumed_from == 4 and losses(rd) == losses(straight)
    assert sealed_steps(rd) == sealed_steps(straight) == [4, 6]
    for step in (4, 6):
        got, want = (run_checkpoints(r, r.load_recipe(), assign=False).root / f"step_{step}" for r in (rd, straight))
        assert torch.equal(torch.load(got / "policy" / "model.pt")["w"], torch.load(want / "policy" / "model.pt")["w"])
    assert len(outcome.checkpoint_write_s) == 1 and len(outcome.checkpoint_save_s) == 1  # step 6: began, sealed


@pytest.mark.slow
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_the_newest(tmp_path, clevr_set, held_writes):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "run", clevr_set, "checkpoint.async_save=true")
    held_writes.add(4)  # step 4's write is still going when the node process dies in step 5
    with pytest.raises(DriverLost):
        run_loop(rd, lost_at=5)
    assert sealed_steps(rd) == [2] and (rd.path / "checkpoints" / "tmp_step_4").is_dir()  # never sealed
    loop, outcome = run_loop(rd, attempt=1)
    assert loop.started_from.step == 2 and outcome.state is State.COMPLETED and losses(rd) == losses(straight)
    assert not (rd.path / "checkpoints" / "tmp_step_4").exists()


# ---------------------------------------------------------------- the node's verdict on the checkpoint


def verdict_loop(rd: RunDirectory, attempt: int, candidate, verdict, delay_s: float = 0.3) -> tuple[Loop, object]:
    """A loop that starts from `candidate` while "the node" hashes it: its verdict (checkpoint, skipped)
    comes `delay_s` after the loop started."""
    import threading

    recipe = rd.load_recipe()
    loop = Loop(
        recipe_json=recipe.model_dump_json(),
        run_dir=str(rd.path),
        attempt=attempt,
        model_dir="/unused",
        chosen=(candidate, []),
        awaits_verdict=True,
    )
    loop.ranks = ranks = Ranks()
    timer = threading.Timer(delay_s, lambda: (ranks.calls.append("verdict"), loop.checkpoint_verified(*verdict, None)))
    timer.start()
    try:
        return loop, loop.run()
    finally:
        timer.cancel()


def candidates(rd: RunDirectory) -> dict:
    """step -> the sealed checkpoint of it, unverified (as the node's stat-only choice gives it)."""
    from vlmrun.checkpoint.manifest import read_manifest
    from vlmrun.checkpoint.read import Checkpoint

    return {
        s: Checkpoint(s, p, read_manifest(p)) for s, p in run_checkpoints(rd, rd.load_recipe(), assign=False).complete()
    }


def test_the_loop_loads_nothing_before_the_nodes_verdict_and_loads_what_it_names(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "run", clevr_set)
    run_loop(rd, stop_at=4)  # checkpoints at 2 and 4
    found = candidates(rd)
    loop, outcome = verdict_loop(rd, 1, found[4], (found[4], []))
    assert loop.group.calls.index("verdict") < loop.group.calls.index("load")  # waited for it
    assert outcome.resumed_from == 4 and losses(rd) == losses(straight)


def test_a_verdict_of_an_older_checkpoint_resumes_that_one(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "run", clevr_set)
    run_loop(rd, stop_at=4)
    found = candidates(rd)  # the node found step 4 damaged, moved it aside and took step 2
    loop, outcome = verdict_loop(rd, 1, found[4], (found[2], ["skipped step_4: policy/model.pt checksum mismatch"]))
    assert loop.group.loaded == (2, False) and outcome.resumed_from == 2
    assert outcome.skipped_checkpoints == ["skipped step_4: policy/model.pt checksum mismatch"]
    assert losses(rd) == losses(straight)  # steps 3 and 4 trained again to the same numbers


def test_a_verdict_of_no_valid_checkpoint_trains_from_step_0_on_the_models_own_weights(tmp_path, clevr_set):
    straight = make_run(tmp_path / "straight", clevr_set)
    run_loop(straight)
    rd = make_run(tmp_path / "run", clevr_set)
    run_loop(rd, stop_at=4)
    found = candidates(rd)
    loop, outcome = verdict_loop(rd, 1, found[4], (None, ["skipped step_4: ...", "skipped step_2: ..."]))
    assert "load_model_weights" in loop.group.calls and "load" not in loop.group.calls
    assert outcome.resumed_from is None and losses(rd) == losses(straight)  # all 6 steps again, from 0
