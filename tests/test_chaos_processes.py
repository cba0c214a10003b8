"""Processes and signals, as a hostile user meets them, with real runs on the local cluster.

One live attempt per run dir (a second resume is refused naming the holder); a SIGKILLed node takes
every process of its attempt with it, writes nothing more and leaves no temp dir; a stop signal counts
from the first instant (before Ray is up: STOPPED, nothing trained) and lands after the step in
flight; Ctrl-C on `submit --wait` stops at a checkpoint, a second one kills hard; `cancel` prints the
state the job really ended in. Processes are counted by the attempt's marker, read from the node's
reaper (python -m vlmrun.cluster.reaper --marker M --temp-root T), so other runs on the host never count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vlmrun.cluster.reaper import marked_processes
from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
GONE_S = 10.0  # everything of a dead node's attempt must be gone by then


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    """A long run of tiny steps (it ends by our signals), checkpoints every 5 steps."""
    data = tmp_path_factory.mktemp("chaos-data") / "clevr"
    pairs = {
        "data.path": str(data),
        "data.synthetic": "{train: 128, val: 16, image_size: 64, seed: 0}",
        "train.max_steps": "400",
        "train.epochs": "50",
        "checkpoint.save_period": "5",
        "train.val_samples": "0",
        "logger.wandb_mode": "disabled",
    }
    return [arg for k, v in pairs.items() for arg in ("--set", f"{k}={v}")]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRUN_JOBS_DIR", str(tmp_path / "jobs"))


def vlmrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args],
        capture_output=True,
        text=True,
        env=ENV | {"VLMRUN_JOBS_DIR": os.environ.get("VLMRUN_JOBS_DIR", "")},
        cwd=ROOT,
        timeout=timeout,
    )


class Launcher:
    """`vlmrun ...` in a session of its own (as from a terminal), stderr kept in a file."""

    def __init__(self, tmp: Path, *args: str, name: str = "launcher"):
        self.err = tmp / f"{name}.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vlmrun.cli", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=ENV | {"VLMRUN_JOBS_DIR": os.environ.get("VLMRUN_JOBS_DIR", "")},
                cwd=ROOT,
                start_new_session=True,
            )

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what the terminal sends to its foreground group

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            with _quiet():
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stderr(self) -> str:
        return self.err.read_text()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        return exc_type is not None and issubclass(exc_type, (ProcessLookupError, PermissionError))


def submit(tmp: Path, run: Path, sets: list[str], *extra: str, wait: bool = True) -> Launcher:
    args = ["submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, *extra]
    return Launcher(tmp, *args, *(["--wait"] if wait else []), name=run.name)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def last_step(run: Path) -> int:
    h = history(run / "metrics.jsonl")
    return max(h) if h else 0


def checkpoints(run: Path) -> list[str]:
    """What the run's checkpoint folder holds besides owner.json (the run it belongs to)."""
    d = run / "checkpoints"
    return sorted(p.name for p in d.iterdir() if p.name != "owner.json") if d.is_dir() else []


def node_pid(run: Path) -> int:
    """The node process, as soon as the launcher described it as the run lock's holder."""

    def holder():
        try:
            return json.loads((run / "lock.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    return wait_for(holder, 60, "the node to start")


def attempt_of(node: int) -> tuple[str, Path]:
    """(marker, temp root) of the node's attempt, from its reaper's command line (it outlives the node)."""

    def reaper():
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "vlmrun.cluster.reaper" in cmd and cmd[cmd.index("--pid") + 1] == str(node):
                return cmd[cmd.index("--marker") + 1], Path(cmd[cmd.index("--temp-root") + 1])
        return None

    return wait_for(reaper, 30, "the node's reaper")


def job(run: Path) -> dict:
    return json.loads((run / "job.json").read_text())


def all_gone_within(marker: str, timeout: float) -> float:
    t0 = time.monotonic()
    wait_for(lambda: not marked_processes(marker), timeout, f"the processes of attempt {marker} to end", poll=0.02)
    return time.monotonic() - t0


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


# ---------------------------------------------------------------- SIGKILL of the node, then two resumes


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, sets) -> dict:
    """A run whose node was SIGKILLed at step >= 6, with what was seen around the kill."""
    tmp = tmp_path_factory.mktemp("killed")
    run = tmp / "run"
    launcher = submit(tmp, run, [*sets, "--set", "logger.wandb_mode=offline"])  # wandb too: its temp dirs
    node = node_pid(run)
    marker, temp_root = attempt_of(node)
    wait_for(lambda: last_step(run) >= 6, 300, "step 6")
    census = {p: psutil.Process(p).name() for p in marked_processes(marker)}
    seen = {"temp_root_before": temp_root.is_dir(), "temp_files_before": sorted(os.listdir(temp_root))}
    step, ckpts = last_step(run), checkpoints(run)
    os.kill(node, signal.SIGKILL)
    gone_s = all_gone_within(marker, GONE_S)
    time.sleep(2.0)  # anything still able to write would have written a row by now (steps take ~0.1 s)
    code = launcher.wait(60)
    return dict(
        seen,
        run=run,
        tmp=tmp,
        census=census,
        gone_s=gone_s,
        step=step,
        ckpts=ckpts,
        step_after=last_step(run),
        ckpts_after=checkpoints(run),
        temp_root=temp_root,
        code=code,
        launcher_err=launcher.stderr(),
    )


def test_sigkill_of_the_node_ends_every_process_of_the_attempt(killed_run):
    k = killed_run
    names = sorted(k["census"].values())
    print(f"SIGKILL of the node: {len(names)} processes gone in {k['gone_s']:.2f}s: {names}")
    assert "raylet" in names and "gcs_server" in names, names  # Ray's agents may still be called python
    assert sum(n.startswith("ray::SftWorker") for n in names) == 2 and any("SftController" in n for n in names)
    assert k["gone_s"] < GONE_S
    assert (k["step_after"], k["ckpts_after"]) == (k["step"], k["ckpts"])  # nothing written after the kill
    assert k["temp_root_before"] and any("wandb" in f for f in k["temp_files_before"]), k["temp_files_before"]
    assert not k["temp_root"].exists()  # Ray's, wandb's and our temp files went with it
    assert k["code"] != 0 and "Traceback" not in k["launcher_err"]
    record = job(k["run"])
    assert record["state"] == "KILLED" and [a["state"] for a in record["attempts"]] == ["KILLED"]
    st = vlmrun("status", str(k["run"]), "--json")
    assert json.loads(st.stdout)["state"] == "KILLED"


def test_two_resumes_at_once_exactly_one_trains(killed_run):
    run, tmp = killed_run["run"], killed_run["tmp"]
    args = ("resume", str(run), "--set", f"train.max_steps={killed_run['step'] + 6}", "--wait")
    a, b = Launcher(tmp, *args, name="resume-a"), Launcher(tmp, *args, name="resume-b")
    codes = sorted([a.wait(), b.wait()])
    assert codes == [0, 2], (codes, a.stderr()[-2000:], b.stderr()[-2000:])
    refused = (a if a.proc.returncode == 2 else b).stderr()
    trained = job(run)["attempts"][-1]
    assert f"pid {trained['pid']} on {trained['host']} (job {trained['job_id']}" in refused, refused
    assert 1 <= len(refused.strip().splitlines()) <= 2 and "Traceback" not in refused
    record = job(run)
    assert [a["state"] for a in record["attempts"]] == ["KILLED", "COMPLETED"]  # the refused one began nothing
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checkpointed = int(killed_run["ckpts"][-1][len("step_") :])
    assert [r["step"] for r in rows if r["attempt"] == 1] == list(range(checkpointed + 1, killed_run["step"] + 7))
    end = killed_run["step"] + 6  # what the resumed attempt says is true of it, and its own
    trained = end - checkpointed
    assert (
        record["attempts"][1]["reason"]
        == record["reason"]
        == (f"finished at step {end} of {end}; {trained} step(s) in this attempt, resumed at step {checkpointed}")
    )
    assert record["attempts"][0]["reason"] != record["reason"]


# ---------------------------------------------------------------- stop signals


@pytest.mark.parametrize(
    "signum,to,after_s",
    [
        (signal.SIGTERM, "node", 0.0),  # at once: the node has not even imported
        (signal.SIGUSR2, "node", 4.0),  # while it imports and starts Ray
        (signal.SIGINT, "launcher", 2.0),  # Ctrl-C in the terminal
    ],
    ids=["SIGTERM-at-once", "SIGUSR2-after-4s", "Ctrl-C-after-2s"],
)
def test_stop_signal_at_start_up_stops_before_the_first_step(tmp_path, sets, registry, signum, to, after_s):
    run = tmp_path / "run"
    launcher = submit(tmp_path, run, sets)
    node = node_pid(run)
    time.sleep(after_s)
    assert last_step(run) == 0
    t0 = time.monotonic()
    launcher.ctrl_c() if to == "launcher" else os.kill(node, signum)
    marker, temp_root = attempt_of(node)
    assert launcher.wait() == 3, launcher.stderr()[-3000:]
    print(f"{signal.Signals(signum).name} {after_s}s after the node started: stopped in {time.monotonic() - t0:.1f}s")
    attempt = job(run)["attempts"][-1]
    assert (attempt["state"], attempt["last_step"], attempt["stop_signal"]) == ("STOPPED", 0, signum.name)
    assert job(run)["state"] == "STOPPED" and last_step(run) == 0 and checkpoints(run) == []
    no_traceback(launcher.stderr())
    all_gone_within(marker, GONE_S)
    assert not temp_root.exists()


@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_stop_mid_run_checkpoints_the_step_in_flight(tmp_path, sets, registry, signum):
    """SIGUSR2/SIGTERM to every process of the attempt (what `scancel [--signal=USR2]` does: Ray's
    processes must not die of it); SIGINT to the launcher's process group (Ctrl-C on `submit --wait`)."""
    run = tmp_path / "run"
    launcher = submit(tmp_path, run, sets)
    node = node_pid(run)
    marker, _ = attempt_of(node)
    wait_for(lambda: last_step(run) >= 7, 300, "step 7")
    in_flight = last_step(run) + 1
    t0 = time.time()
    if signum == signal.SIGINT:
        launcher.ctrl_c()
    else:
        for pid in [node, *marked_processes(marker)]:
            with _quiet():
                os.kill(pid, signum)
    assert launcher.wait() == 3, launcher.stderr()[-3000:]
    attempt = job(run)["attempts"][-1]
    stopped_at = attempt["last_step"]
    row = history(run / "metrics.jsonl")[stopped_at]
    how = signum.name
    print(f"{how} during step {in_flight}: checkpointed at step {stopped_at}, {row['time'] - t0:.3f}s after the signal")
    assert in_flight - 1 <= stopped_at <= in_flight + 1  # the step in flight (its row may just have been written)
    assert attempt["state"] == "STOPPED" and f"step_{stopped_at}" in checkpoints(run)
    assert last_step(run) == stopped_at
    assert attempt["stop_signal"] == how
    no_traceback(launcher.stderr())


def test_second_ctrl_c_kills_hard(tmp_path, sets, registry):
    run = tmp_path / "run"
    launcher = submit(tmp_path, run, sets)
    node = node_pid(run)
    marker, temp_root = attempt_of(node)
    wait_for(lambda: last_step(run) >= 3, 300, "step 3")
    launcher.ctrl_c()
    time.sleep(0.3)  # two presses, not one coalesced signal
    t0 = time.monotonic()
    launcher.ctrl_c()
    all_gone_within(marker, GONE_S)
    print(f"second Ctrl-C: every process of the attempt gone {time.monotonic() - t0:.2f}s after it")
    assert launcher.wait() == 130
    err = launcher.stderr()
    assert "killing the job" in err and "hard" in err, err[-2000:]
    assert job(run)["state"] == "KILLED"
    # the reaper removes the temp root once every process is gone: it may still be at it
    wait_for(lambda: not temp_root.exists(), GONE_S, "the attempt's temp root to be removed")
    no_traceback(err)


# ---------------------------------------------------------------- cancel


def test_cancel_right_after_submit_says_how_the_job_ended(tmp_path, sets, registry):
    run = tmp_path / "run"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    cancel = vlmrun("cancel", str(run), "--json")
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    said = json.loads(cancel.stdout)
    record = job(run)
    assert said["state"] == record["state"] == "CANCELLED", (said, record)
    assert record["attempts"][-1]["last_step"] == 0 and last_step(run) == 0  # it trained nothing


def test_cancel_mid_run_checkpoints_and_says_cancelled(tmp_path, sets, registry):
    run = tmp_path / "run"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    node = node_pid(run)
    marker, _ = attempt_of(node)
    wait_for(lambda: last_step(run) >= 3, 300, "step 3")
    holder = f"pid {node} on {os.uname().nodename} (job local-{node}"
    for refused in (
        vlmrun("resume", str(run)),
        vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *sets),
    ):
        assert refused.returncode == 2 and holder in refused.stderr, refused.stderr  # while it runs
    cancel = vlmrun("cancel", str(run))
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    assert "state: CANCELLED" in cancel.stdout, cancel.stdout
    attempt = job(run)["attempts"][-1]
    assert job(run)["state"] == "CANCELLED" and attempt["state"] == "STOPPED"
    assert f"step_{attempt['last_step']}" in checkpoints(run) and last_step(run) == attempt["last_step"]
    assert not marked_processes(marker)
