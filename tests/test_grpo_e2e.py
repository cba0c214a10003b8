"""Sync GRPO end to end on the tiny recipe: real Ray, real Energon, the real tiny Qwen2.5-VL, via the CLI.

The policy starts from a short SFT run exported with `vlmrun export` (a random model earns almost no
reward). What users depend on: every data-plane setting (local, TransferQueue simple and Mooncake, and
no plane) gives the same numbers at every step; with one inner step the ratio is exactly 1; a SIGKILLed
run resumed with `vlmrun resume` matches an uninterrupted one; the plane is empty at step boundaries.
A SIGKILLed server of the job's plane (storage unit, TransferQueue controller, mooncake_master) fails
the attempt within 30 s with one line naming it, a node killed with its reaper leaves no process and no
temp root behind, and either way `vlmrun resume` finishes the run as if nothing happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
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
GRPO = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
SFT = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
SAME = (
    *("loss", "grad_norm", "lr", "valid_tokens", "sample_ids", "reward", "advantage_mean"),
    *("token_mult_prob_error", "probs_ratio_min", "probs_ratio_max"),
)
#: Keys every GRPO row carries: the run contract's and GRPO's own (metrics.py)
ROW_KEYS = """step attempt consumed_samples step_time_s loader_latency_max_s peak_rss_mb accuracy
kl gen_kl_error sampling_importance_ratio advantage_min advantage_max response_length_mean time_generation_s
time_refit_s time_logprob_s time_advantage_s time_train_s time_data_plane_s plane_bytes val_accuracy""".split()
PLANES = {
    "local": ["data_plane.impl=local"],
    "tq_simple": ["data_plane.impl=transfer_queue", "data_plane.backend=simple"],
    "tq_mooncake": ["data_plane.impl=transfer_queue", "data_plane.backend=mooncake"],
    "driver": ["data_plane.enabled=false"],
}


def vlmrun(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600
    )


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """A small data set and the policy: 40 SFT steps on it, exported."""
    work = tmp_path_factory.mktemp("grpo")
    data = [f"data.path={work / 'clevr'}", "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}"]
    quiet = ["logger.wandb_mode=disabled", "train.val_samples=8"]
    sft = vlmrun(
        "submit",
        SFT,
        "--cluster",
        "local",
        "--run-dir",
        str(work / "sft"),
        *sets(*data, *quiet, "train.max_steps=40"),
        "--wait",
    )
    assert sft.returncode == 0, sft.stderr[-3000:]
    out = vlmrun("export", str(work / "sft"), str(work / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.val_period=3"]  # a step in ~0.3 s
    return sets(*data, *quiet, *small, "model.tiny=false", f"model.path={work / 'model'}")


def grpo(run: Path, base: list[str], *items: str) -> dict[int, dict]:
    out = vlmrun("submit", GRPO, "--cluster", "local", "--run-dir", str(run), *base, *sets(*items), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return history(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, base) -> dict[int, dict]:
    return grpo(tmp_path_factory.mktemp("runs") / "local", base, "train.max_steps=3", *PLANES["local"])


def test_one_inner_step_keeps_the_ratio_at_one_and_rows_carry_the_contract(local_run):
    assert sorted(local_run) == [1, 2, 3]
    for row in local_run.values():
        assert row["probs_ratio_min"] == 1.0 == row["probs_ratio_max"]
        assert len(row["sample_ids"]) == 8 and row["valid_tokens"] > 0 and row["grad_norm"] > 0
    assert statistics.median(r["token_mult_prob_error"] for r in local_run.values()) < 1.05
    row = local_run[3]
    for key in ROW_KEYS:
        assert key in row, key
    assert any(k.startswith("accuracy/") for k in row) and row["consumed_samples"] == 24


@pytest.mark.parametrize("plane", ["tq_simple", "tq_mooncake", "driver"])
def test_every_data_plane_setting_gives_the_same_numbers(tmp_path, base, local_run, plane):
    if plane == "tq_mooncake":
        from vlmrun.cluster.mooncake import mooncake_unavailable

        if mooncake_unavailable():
            pytest.skip(mooncake_unavailable())
    other = grpo(tmp_path / plane, base, "train.max_steps=3", *PLANES[plane])
    for step, row in local_run.items():
        for key in SAME:
            assert other[step][key] == row[key], (plane, step, key)
    assert (other[1]["plane_bytes"] == 0) == (plane == "driver")


def test_two_inner_steps_move_the_ratio_off_one_and_the_kl_penalty_sees_it(tmp_path, base):
    rows = grpo(tmp_path / "inner", base, "train.max_steps=2", "grpo.inner_steps=2", "grpo.kl_coef=0.05")
    assert all(r["probs_ratio_min"] < 1.0 < r["probs_ratio_max"] for r in rows.values())
    assert all(r["kl"] > 0 for r in rows.values())  # the reference logprobs went through the plane


RESUMED = ["train.max_steps=8", "checkpoint.save_period=2"]  # the runs that are killed and resumed


@pytest.fixture(scope="module")
def want(tmp_path_factory, base) -> dict[int, dict]:
    """The uninterrupted run that every killed and resumed run must match."""
    return grpo(tmp_path_factory.mktemp("runs") / "uninterrupted", base, *RESUMED)


def assert_same_history(run: Path, want: dict[int, dict]) -> None:
    got = history(run / "metrics.jsonl")
    assert sorted(got) == sorted(want)
    for step in want:
        for key in (*SAME, "probs_ratio_max", "accuracy"):
            assert got[step][key] == want[step][key], (step, key)


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, base, want):
    run = tmp_path / "b"
    cmd = [sys.executable, "-m", "vlmrun.cli", "submit", GRPO, "--cluster", "local", "--run-dir", str(run)]
    proc = subprocess.Popen(
        [*cmd, *base, *sets(*RESUMED), "--wait"],
        env=ENV,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while max(history(run / "metrics.jsonl") or [0]) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_history(run, want)
    job = json.loads((run / "job.json").read_text())
    assert [a["state"] for a in job["attempts"]] == ["KILLED", "COMPLETED"]
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert {p.name for p in (checkpoint / "generation").iterdir()} == {"replica_0.pt", "replica_1.pt"}


# ---------------------------------------------------------------- the job's own servers, killed mid-step

GONE_S = 10.0  # everything of an attempt is gone this long after its node ended
#: what a dead server's attempt says: one line naming it (pid of the victim filled in)
NAMED = {
    "storage unit": r"the TransferQueue storage unit storage-0 \(actor [0-9a-f]+, pid {pid} on [\d.]+\) died",
    "controller": r"the TransferQueue controller \(actor [0-9a-f]+, pid {pid} on [\d.]+\) died",
    "mooncake_master": r"mooncake_master \(pid {pid}, port \d+ on [\d.]+\) exited with signal SIGKILL "
    r"\(its log: \S+/logs/mooncake-master\.log\)",
}
PROCESS = {"storage unit": "ray::SimpleStorageUnit", "controller": "ray::TransferQueueController"}
#: on a console or in an attempt log, none of these: a traceback, a key dump, Mooncake's glog, Ray's auth line
NOISE = re.compile(
    r"Traceback|@response_ids|[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|InitGoogleLogging|Token auth"
)


def kill_mid_step(run: Path, args: list[str], at_step: int, victim: str) -> dict:
    """`vlmrun <args> --wait`; once step `at_step` is done, SIGKILL `victim` ("storage unit", "controller",
    "mooncake_master" or "node+reaper"). Returns what was seen: victims, exit code, seconds from the kill
    to the launcher's end (`ended_s`) and to the last process of the attempt and its temp root (`gone_s`)."""
    err = run.parent / f"{run.name}-{len(list(run.parent.glob(run.name + '-*.err')))}.err"
    with open(err, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "vlmrun.cli", *args, "--wait"], env=ENV, cwd=ROOT, stderr=out, start_new_session=True
        )
    try:
        node = wait_for(lambda: _node_of(run), 120, "the attempt's node")
        marker, temp_root, reaper = wait_for(lambda: _reaper_of(node), 30, "the node's reaper")
        wait_for(lambda: max(history(run / "metrics.jsonl") or [0]) >= at_step, 300, f"step {at_step}")
        census = {p: psutil.Process(p).name() for p in marked_processes(marker)}
        if victim == "node+reaper":
            victims = [node, reaper]
        else:
            name = PROCESS.get(victim, victim)
            victims = [p for p, n in census.items() if n.startswith(name)]
        assert len(victims) == (2 if victim == "node+reaper" else 1), (victim, census)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = launcher.wait(timeout=120)
        ended_s = time.monotonic() - t0
        wait_for(lambda: not _alive(census) and not temp_root.exists(), ended_s + GONE_S, "the attempt's end")
        gone_s = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    attempt = json.loads((run / "job.json").read_text())["attempts"][-1]
    return dict(victims=victims, census=census, code=code, ended_s=ended_s, gone_s=gone_s, attempt=attempt, err=err)


def _node_of(run: Path) -> int | None:
    """The pid of the run's live node process, once the lock describes it."""
    try:
        pid = json.loads((run / "lock.json").read_text())["pid"]
        return pid if "vlmrun.cluster.node" in psutil.Process(pid).cmdline() else None
    except (OSError, ValueError, KeyError, psutil.Error):
        return None


def _reaper_of(node: int) -> tuple[str, Path, int] | None:
    """(marker, temp root, pid) of the node's reaper (not its guard), from the reaper's command line."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vlmrun.cluster.reaper" in cmd and "--after" not in cmd and cmd[cmd.index("--pid") + 1] == str(node):
            return cmd[cmd.index("--marker") + 1], Path(cmd[cmd.index("--temp-root") + 1]), p.pid
    return None


def _alive(census: dict[int, str]) -> list[int]:
    """The processes of `census` still running (same pid, same name: not a reused pid)."""
    alive = []
    for pid, name in census.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.name() == name and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def assert_failed_naming(seen: dict, victim: str) -> None:
    """The attempt ended FAILED within 30 s, its reason one line naming the server, said once and quietly."""
    a, err = seen["attempt"], seen["err"].read_text()
    print(f"{victim} SIGKILLed: attempt FAILED {seen['ended_s']:.1f}s later: {a['reason']}")
    assert seen["code"] == 1 and a["state"] == "FAILED" and seen["ended_s"] < 30, (seen, err[-3000:])
    assert re.match(NAMED[victim].format(pid=seen["victims"][0]) + "; `vlmrun resume` continues", a["reason"]), a
    assert err.count(a["reason"]) == 1 and "\n" not in a["reason"], err[-3000:]
    assert not NOISE.search(err), NOISE.search(err)
    assert seen["gone_s"] < seen["ended_s"] + GONE_S


CHAINS = {  # (plane, the first attempt's victim, the resumed attempt's victim)
    "simple": ("simple", "storage unit", "controller"),
    "mooncake": ("mooncake", "mooncake_master", "node+reaper"),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_dead_plane_servers_fail_the_attempt_naming_them_and_resume_matches(tmp_path, base, want, chain):
    backend, first, second = CHAINS[chain]
    if backend == "mooncake":
        from vlmrun.cluster.mooncake import mooncake_unavailable

        if mooncake_unavailable():
            pytest.skip(mooncake_unavailable())
    run = tmp_path / "run"
    plane = ["data_plane.impl=transfer_queue", f"data_plane.backend={backend}"]
    submit = ["submit", GRPO, "--cluster", "local", "--run-dir", str(run), *base, *sets(*RESUMED, *plane)]
    seen = kill_mid_step(run, submit, 2, first)
    assert_failed_naming(seen, first)
    filed = (run / "logs" / "attempt-0.third-party.log").read_text().count("metadata not found")
    assert (filed > 0) == (backend == "mooncake")  # Mooncake's chatter (every client's, at its start), filed
    seen = kill_mid_step(run, ["resume", str(run)], 5, second)
    if second == "node+reaper":
        names = sorted(seen["census"].values())
        print(f"node and reaper SIGKILLed: {len(names)} processes gone in {seen['gone_s']:.2f}s: {names}")
        assert "mooncake_master" in names and "raylet" in names and "ray::TransferQueueController" in names, names
        assert seen["gone_s"] < GONE_S and seen["attempt"]["state"] == "KILLED"
    else:
        assert_failed_naming(seen, second)
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0 and not NOISE.search(out.stderr), out.stderr[-3000:]
    assert_same_history(run, want)
    states = [a["state"] for a in json.loads((run / "job.json").read_text())["attempts"]]
    assert states == ["FAILED", "KILLED" if second == "node+reaper" else "FAILED", "COMPLETED"]
    for log in (run / "logs").glob("attempt-*.log"):
        if ".third-party." not in log.name:
            assert not NOISE.search(log.read_text()), (log, NOISE.search(log.read_text()))
