"""Processes and signals, as a hostile user meets them, with real runs on the local cluster; and every
way a run is interrupted, one after the other on one run, resumed to the numbers of the uninterrupted run.

The chain (one run directory, the arguments of the session's `sft_baseline`), an attempt per test, in order:
1. SIGKILL of the node: every process of the attempt is gone within 10 s, nothing more is written, the
   temp root (Ray's, wandb's files) is removed; the attempt is KILLED. Its controller, past a validation
   and checkpoints, holds no torch (nor does test 3's, resumed).
2. Two resumes at once: one trains, the other is refused naming the holder and begins nothing; SIGUSR2
   to every process of the attempt (what `scancel --signal=USR2` does) lands after the step in flight.
3. `cancel` of a detached attempt: while it runs a resume and a submit into it are refused naming it;
   cancel checkpoints, says CANCELLED and leaves no process.
4. SIGTERM to every process: the same as SIGUSR2, STOPPED at a checkpoint. 5. Ctrl-C on `resume --wait`:
   the same. 6. Ctrl-C twice: the second kills hard (exit 130), every process gone.
7. A last resume completes: every step equals the uninterrupted run (loss, grad_norm, lr, tokens,
   sample ids), no sample is lost or seen twice, and no attempt after a stop recomputed a step.

Besides: a stop signal counts from the first instant (before Ray is up: STOPPED, nothing trained), a
second Ctrl-C after the first one's checkpoint was sealed says that checkpoint stays, and `cancel` right
after a detached submit says how the job ended. Processes are counted by the attempt's
marker, read from the node's reaper, so other runs on the host never count.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from shared_runs import SFT_STEPS
from vlmrun_cli import (
    TINY,
    Launcher,
    census,
    checkpoints,
    job,
    last_step,
    node_pid,
    reaper_of,
    rows,
    same_history,
    sealed,
    sets,
    signal_attempt,
    states,
    vlmrun,
    wait_for,
)

from vlmrun.cluster.reaper import marked_processes
from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GONE_S = 10.0  # everything of a dead node's attempt must be gone by then
QUIET = sets("logger.wandb_mode=disabled")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRUN_JOBS_DIR", str(tmp_path / "jobs"))


def all_gone_within(marker: str, timeout: float) -> float:
    t0 = time.monotonic()
    wait_for(lambda: not marked_processes(marker), timeout, f"the processes of attempt {marker} to end", poll=0.02)
    return time.monotonic() - t0


def retained(names: list[str]) -> bool:
    """Retention (keep 2) is done: two checkpoints at most, and the folder of the one it removed is gone
    (renamed `.deleting_*` first, out of every listing, then its files go)."""
    return sum(n.startswith("step_") for n in names) <= 2 and not any(n.startswith(".deleting_") for n in names)


def kept(names: list[str]) -> list[str]:
    """The checkpoint folders a kill must leave as they were: a `.deleting_*` one, whose removal was in flight
    when the node died (`os.kill` returns before it has), is swept by the next save."""
    return [n for n in names if not n.startswith(".deleting_")]


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def torch_in(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (the SFT controller never does: common/loop.py, 5)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def first_step_of(run: Path, attempt: int) -> int:
    return min(r["step"] for r in rows(run) if r["attempt"] == attempt)


# ---------------------------------------------------------------- the chain


class Chain:
    """One run directory interrupted in every way, attempt after attempt (the tests below, in order)."""

    def __init__(self, folder: Path, args: list[str]):
        self.folder, self.run, self.args = folder, folder / "run", args
        self.seen: dict[str, dict] = {}

    def launch(self, *args: str, name: str) -> Launcher:
        return Launcher(self.folder, *args, name=name)

    def resume(self, name: str, *extra: str) -> Launcher:
        return self.launch("resume", str(self.run), *QUIET, *extra, "--wait", name=name)

    def past(self, steps: int = 2, timeout: float = 300) -> int:
        """Wait until the attempt sealed a checkpoint `steps` steps past the run's last step now; that step."""
        target = last_step(self.run) + steps
        wait_for(lambda: any(s >= target for s in sealed(self.run)), timeout, f"a checkpoint at step {target}")
        return target

    def stop_in_flight(self, launcher: Launcher, send) -> dict:
        """Once the attempt is past a checkpoint of its own: `send()` a stop; what the attempt then says."""
        self.past()
        in_flight = last_step(self.run) + 1
        send()
        code = launcher.wait()
        attempt = job(self.run)["attempts"][-1]
        return dict(code=code, in_flight=in_flight, attempt=attempt, err=launcher.stderr())


@pytest.fixture(scope="module")
def chain(tmp_path_factory, sft_sets, sft_baseline) -> Chain:
    return Chain(tmp_path_factory.mktemp("chain"), sft_sets)


def assert_stopped_after_the_step_in_flight(chain: Chain, seen: dict, signame: str) -> None:
    attempt, run = seen["attempt"], chain.run
    stopped_at = attempt["last_step"]
    print(f"{signame} during step {seen['in_flight']}: checkpointed at step {stopped_at}")
    assert seen["code"] == 3, seen["err"][-3000:]  # stopped at a checkpoint, resumable
    assert seen["in_flight"] - 1 <= stopped_at <= seen["in_flight"] + 1  # its row may just have been written
    assert attempt["state"] == "STOPPED" and attempt["stop_signal"] == signame
    assert f"step_{stopped_at}" in checkpoints(run) and last_step(run) == stopped_at
    assert attempt["reason"] == f"stop requested ({signame}); checkpointed at step {stopped_at}"
    no_traceback(seen["err"])


def test_1_sigkill_of_the_node_ends_every_process_of_the_attempt(chain):
    run = chain.run
    args = ["submit", TINY, "--cluster", "local", "--run-dir", str(run), *chain.args]
    launcher = chain.launch(*args, *sets("logger.wandb_mode=offline"), "--wait", name="submit")  # wandb's temp dirs too
    node = node_pid(run)
    marker, temp_root, _ = reaper_of(node)
    chain.past(10)  # past the validation at step 10
    # the seal publishes a checkpoint, then retention (keep 2) removes the oldest: let it be done
    wait_for(lambda: retained(checkpoints(run)), 30, "the retention of the seal")
    processes = census(marker)
    assert not torch_in(next(pid for pid, name in processes.items() if "SftController" in name))
    temp_files = sorted(os.listdir(temp_root))
    step, ckpts = last_step(run), kept(checkpoints(run))
    os.kill(node, signal.SIGKILL)
    gone_s = all_gone_within(marker, GONE_S)
    time.sleep(2.0)  # anything still able to write would have written a row by now (steps take ~0.3 s)
    code = launcher.wait(60)
    names = sorted(processes.values())
    print(f"SIGKILL of the node: {len(names)} processes gone in {gone_s:.2f}s: {names}")
    assert "raylet" in names and "gcs_server" in names, names  # Ray's agents may still be called python
    assert sum(n.startswith("ray::SftWorker") for n in names) == 2 and any("SftController" in n for n in names)
    assert gone_s < GONE_S
    # Nothing written once the node is gone. `os.kill` returns before the node has died: on busy CPUs it
    # may run a few ms more, and the row of the step in flight, whose writer found the node alive just
    # before it wrote, can land meanwhile (seen once in ~6 runs of the suite); nothing after that row.
    assert last_step(run) in (step, step + 1) and kept(checkpoints(run)) == ckpts
    assert any("wandb" in f for f in temp_files), temp_files
    assert not temp_root.exists()  # Ray's, wandb's and our temp files went with it
    assert code != 0 and "Traceback" not in launcher.stderr()
    assert job(run)["state"] == "KILLED" and states(run) == ["KILLED"]
    st = vlmrun("status", str(run), "--json")
    assert json.loads(st.stdout)["state"] == "KILLED"
    chain.seen["killed"] = {"step": step, "resume_from": max(s for s in sealed(run))}


def test_2_of_two_resumes_at_once_one_trains_and_sigusr2_stops_it_after_the_step_in_flight(chain):
    run = chain.run
    a, b = chain.resume("resume-a"), chain.resume("resume-b")
    refused_one = wait_for(lambda: next((x for x in (a, b) if x.proc.poll() is not None), None), 120, "a refusal")
    trained_one = b if refused_one is a else a
    assert refused_one.proc.returncode == 2, refused_one.stderr()[-2000:]
    refused = refused_one.stderr()
    holder = wait_for(lambda: job(run)["attempts"][1:], 60, "the attempt of the other to begin")[0]
    assert f"pid {holder['pid']} on {holder['host']} (job {holder['job_id']}" in refused, refused
    assert 1 <= len(refused.strip().splitlines()) <= 2 and "Traceback" not in refused
    assert states(run) == ["KILLED", "RUNNING"]  # the refused one began nothing

    # to every process of the attempt: Ray's processes must not die of it
    seen = chain.stop_in_flight(trained_one, lambda: signal_attempt(holder["pid"], signal.SIGUSR2))
    assert_stopped_after_the_step_in_flight(chain, seen, "SIGUSR2")
    assert first_step_of(run, 1) == chain.seen["killed"]["resume_from"] + 1  # from the newest checkpoint


def test_3_cancel_of_a_detached_attempt_checkpoints_and_says_cancelled(chain, registry):
    run = chain.run
    out = vlmrun("resume", str(run), *QUIET, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    node = node_pid(run)
    marker, _, _ = reaper_of(node)
    chain.past()
    holder = f"pid {node} on {os.uname().nodename} (job local-{node}"
    # The run's steps take ~0.3 s: its controller is held still while the two refusals are checked, so
    # a slow machine cannot let the run finish before the cancel comes.
    controller = next(pid for pid, name in census(marker).items() if "SftController" in name)
    assert not torch_in(controller)  # resumed from the checkpoint the killed attempt sealed
    os.kill(controller, signal.SIGSTOP)
    try:
        refusals = (
            vlmrun("resume", str(run)),
            vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *chain.args),
        )
    finally:
        os.kill(controller, signal.SIGCONT)
    for refused in refusals:
        assert refused.returncode == 2 and holder in refused.stderr, refused.stderr  # while it runs
    cancel = vlmrun("cancel", str(run))
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    assert "state: CANCELLED" in cancel.stdout, cancel.stdout
    attempt = job(run)["attempts"][-1]
    assert job(run)["state"] == "CANCELLED" and attempt["state"] == "STOPPED"
    assert f"step_{attempt['last_step']}" in checkpoints(run) and last_step(run) == attempt["last_step"]
    assert not marked_processes(marker)


def test_4_sigterm_to_every_process_stops_after_the_step_in_flight(chain):
    launcher = chain.resume("resume-term")
    node = node_pid(chain.run)
    seen = chain.stop_in_flight(launcher, lambda: signal_attempt(node, signal.SIGTERM))
    assert_stopped_after_the_step_in_flight(chain, seen, "SIGTERM")


def test_5_ctrl_c_on_resume_wait_stops_after_the_step_in_flight(chain):
    launcher = chain.resume("resume-int")
    node_pid(chain.run)
    seen = chain.stop_in_flight(launcher, launcher.ctrl_c)
    assert_stopped_after_the_step_in_flight(chain, seen, "SIGINT")


def test_6_a_second_ctrl_c_kills_hard(chain):
    launcher = chain.resume("resume-int-int")
    node = node_pid(chain.run)
    marker, temp_root, _ = reaper_of(node)
    chain.past()
    # The controller is held still: the first press's graceful stop cannot end (a step that takes long)
    # before the second press, however fast the machine (steps take ~0.3 s).
    controller = next(pid for pid, name in census(marker).items() if "SftController" in name)
    os.kill(controller, signal.SIGSTOP)
    launcher.ctrl_c()
    time.sleep(0.3)  # two presses, not one coalesced signal
    t0 = time.monotonic()
    launcher.ctrl_c()
    all_gone_within(marker, GONE_S)
    print(f"second Ctrl-C: every process of the attempt gone {time.monotonic() - t0:.2f}s after it")
    assert launcher.wait() == 130
    err = launcher.stderr()
    assert "killing the job" in err and "hard" in err, err[-2000:]
    assert job(chain.run)["state"] == "KILLED" and states(chain.run)[-1] == "KILLED"
    # the reaper removes the temp root once every process is gone: it may still be at it
    wait_for(lambda: not temp_root.exists(), GONE_S, "the attempt's temp root to be removed")
    no_traceback(err)


def test_7_the_resumed_run_equals_the_uninterrupted_one_step_for_step(chain, sft_baseline):
    run = chain.run
    out = vlmrun("resume", str(run), *QUIET, "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    record = job(run)
    assert states(run) == ["KILLED", "STOPPED", "STOPPED", "STOPPED", "STOPPED", "KILLED", "COMPLETED"]
    assert record["state"] == "COMPLETED"
    same_history(run, sft_baseline)
    # no sample lost or seen twice across the interruptions: per epoch, the same ids as often
    assert epoch_ids(run) == epoch_ids(sft_baseline) and sum(epoch_ids(run)[0].values()) == 256
    attempts = record["attempts"]
    for k in range(1, len(attempts)):  # each attempt starts after the checkpoint it resumed from
        if attempts[k]["state"] == "KILLED":  # a killed attempt recorded nothing of itself
            continue
        assert first_step_of(run, k) == attempts[k]["resumed_from"] + 1, k
        if attempts[k - 1]["state"] == "STOPPED":  # a stop checkpointed its last step: nothing recomputed
            assert attempts[k]["resumed_from"] == attempts[k - 1]["last_step"], k
    start = attempts[-1]["resumed_from"]
    assert (
        record["reason"]
        == attempts[-1]["reason"]
        == (
            f"finished at step {SFT_STEPS} of {SFT_STEPS}; {SFT_STEPS - start} step(s) in this attempt, "
            f"resumed at step {start}"
        )
    )
    assert attempts[0]["reason"] != record["reason"]  # each attempt's reason is its own
    cmp = vlmrun("compare", str(sft_baseline), str(run), "--json", "--out", str(chain.folder / "cmp"))
    assert cmp.returncode == 0 and json.loads(cmp.stdout)["verdict"] == "match", cmp.stdout + cmp.stderr[-2000:]


def epoch_ids(run: Path) -> dict[int, Counter]:
    """epoch -> how often each sample id was trained on in it (each once: vlmrun.data.epochs)."""
    out: dict[int, Counter] = {}
    for row in history(run / "metrics.jsonl").values():
        out.setdefault(row["epoch"], Counter()).update(row["sample_ids"])
    return out


# ---------------------------------------------------------------- before the first step


@pytest.fixture(scope="module")
def long_run(run_data) -> list[str]:
    """A long run of tiny steps that our signals end; no loader worker, no validation."""
    return [*run_data, *sets("train.max_steps=400", "train.epochs=20", "train.val_samples=0", "data.num_workers=0")]


@pytest.mark.parametrize(
    "signum,to,after_s",
    [
        (signal.SIGTERM, "node", 0.0),  # at once: the node has not even imported
        (signal.SIGUSR2, "node", 4.0),  # while it imports and starts Ray
        (signal.SIGINT, "launcher", 2.0),  # Ctrl-C in the terminal
    ],
    ids=["SIGTERM-at-once", "SIGUSR2-after-4s", "Ctrl-C-after-2s"],
)
def test_stop_signal_at_start_up_stops_before_the_first_step(tmp_path, long_run, registry, signum, to, after_s):
    run = tmp_path / "run"
    launcher = Launcher(tmp_path, "submit", TINY, "--cluster", "local", "--run-dir", str(run), *long_run, "--wait")
    node = node_pid(run)
    time.sleep(after_s)
    assert last_step(run) == 0
    t0 = time.monotonic()
    launcher.ctrl_c() if to == "launcher" else os.kill(node, signum)
    marker, temp_root, _ = reaper_of(node)
    assert launcher.wait() == 3, launcher.stderr()[-3000:]
    print(f"{signal.Signals(signum).name} {after_s}s after the node started: stopped in {time.monotonic() - t0:.1f}s")
    attempt = job(run)["attempts"][-1]
    assert (attempt["state"], attempt["last_step"], attempt["stop_signal"]) == ("STOPPED", 0, signum.name)
    assert job(run)["state"] == "STOPPED" and last_step(run) == 0 and checkpoints(run) == []
    no_traceback(launcher.stderr())
    all_gone_within(marker, GONE_S)
    assert not temp_root.exists()


def test_a_second_ctrl_c_after_the_stop_checkpoint_was_sealed_says_it_stays(tmp_path, long_run, registry):
    """The first Ctrl-C's checkpoint is sealed while the node still shuts down (held still here): a second
    Ctrl-C kills it, saying, as job.json records, that the checkpoint of its last step stays. The job is
    named by its node's pid and start time; `vlmrun status <job id>` finds the run; the attempt log holds
    what the reaper said on the console."""
    from vlmrun.run.process import start_time

    run = tmp_path / "run"
    launcher = Launcher(tmp_path, "submit", TINY, "--cluster", "local", "--run-dir", str(run), *long_run, "--wait")
    node = node_pid(run)
    job_id = f"local-{node}-{start_time(node)}"
    marker, _, _ = reaper_of(node)
    wait_for(lambda: last_step(run) >= 1, 300, "the first step")
    launcher.ctrl_c()
    wait_for(lambda: sealed(run), 300, "the checkpoint of the stop", poll=0.01)
    os.kill(node, signal.SIGSTOP)
    step = sealed(run)[-1]
    assert job(run)["attempts"][-1]["state"] == "RUNNING" and step == last_step(run)  # sealed, not yet recorded
    launcher.ctrl_c()
    assert launcher.wait() == 130
    err = launcher.stderr()
    said = f"killing the job (pid {node}) hard, after its checkpoint of step {step} (its last step) was sealed"
    assert said in err and "without a checkpoint" not in err, err[-3000:]
    kept = f"killed by a second Ctrl-C (SIGKILL) after its checkpoint of step {step} (its last step) was sealed"
    wait_for(lambda: not marked_processes(marker), GONE_S, "the attempt's processes to end")
    record = job(run)
    assert record["attempts"][-1]["state"] == record["state"] == "KILLED"
    assert record["attempts"][-1]["reason"] == record["reason"] == kept
    assert record["job_ids"] == [job_id]
    status = vlmrun("status", job_id, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["run_dir"] == str(run), status.stderr[-2000:]
    log = run / "logs" / "attempt-0.log"
    reaper = wait_for(
        lambda: [ln for ln in log.read_text().splitlines() if ln.startswith("vlmrun reaper")], GONE_S, "it"
    )
    assert reaper[0] in launcher.stderr()


def test_cancel_right_after_submit_says_how_the_job_ended(tmp_path, long_run, registry):
    run = tmp_path / "run"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *long_run, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    cancel = vlmrun("cancel", str(run), "--json")
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    said = json.loads(cancel.stdout)
    record = job(run)
    assert said["state"] == record["state"] == "CANCELLED", (said, record)
    assert record["attempts"][-1]["last_step"] == 0 and last_step(run) == 0  # it trained nothing
