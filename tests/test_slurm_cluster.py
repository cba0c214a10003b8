"""On the real local SLURM cluster (tools/slurm/up.sh; 2-node tests: tools/slurm/up-2node.sh) with real Ray.

The payloads below stand in for the training entrypoint (`NodeEntrypoint(run_dir, main=...)`); they
are pickled by value, so the job needs only vlmrun importable. Skipped when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle
import pytest

from vlmrun.cluster.slurm_entry import NodeEntrypoint
from vlmrun.config.load import load_recipe
from vlmrun.launch import control
from vlmrun.launch import logs as launch_logs
from vlmrun.launch import status as launch_status
from vlmrun.launch.slurm import queries
from vlmrun.launch.slurm.submit import submit_slurm, wait_for_job
from vlmrun.run import logs as run_logs
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import read_job
from vlmrun.run.state import State

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sinfo_nodes() -> list[dict] | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    nodes = []
    for line in out.stdout.split("\n"):
        if line.strip():
            name, state = line.split()
            addr = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True).stdout
            nodes.append({"name": name, "state": state, "addr": addr.split("NodeAddr=")[1].split()[0]})
    return nodes


@pytest.fixture(scope="module")
def cluster():
    nodes = sinfo_nodes()
    if not nodes:
        pytest.skip("no SLURM cluster answers `sinfo`; start one with tools/slurm/up.sh")
    return nodes


@pytest.fixture
def two_nodes(cluster):
    if len({n["addr"] for n in cluster}) < 2:
        pytest.skip("needs 2 nodes with their own addresses: SLURM_NETNS=1 tools/slurm/up-2node.sh")
    return cluster


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRUN_JOBS_DIR", str(tmp_path / "registry"))


def recipe(*sets: str):
    return load_recipe(
        ROOT / "recipes" / "tiny-clevr-cpu.yaml",
        ["cluster.cpus_per_node=1", "parallel.dp=1", "cluster.mem_gb=2", *sets],
    )


# ---------------------------------------------------------------- payloads (run inside the job)


def complete_main(argv: list[str]) -> int:
    from vlmrun.run import job as job_record
    from vlmrun.run.outcome import RunOutcome
    from vlmrun.run.state import State

    rd = RunDirectory(argv[1])
    attempt = job_record.begin_attempt(rd, os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", 0)))
    print("payload ran on", os.environ["SLURMD_NODENAME"], flush=True)
    job_record.end_attempt(rd, attempt, RunOutcome(State.COMPLETED, last_step=1, reason="done"))
    return 0


def stop_then_complete_main(argv: list[str]) -> int:
    """Attempt 0 trains until the stop flag is set (USR2), 'checkpoints', returns 3; a restart completes.

    Like the real driver, the STOPPED outcome carries the signal as `stop_signal`: the requeue decision
    reads only that field.
    """
    from vlmrun.algorithms.common.stop import StopFlag, ignore_stop_signals
    from vlmrun.run import job as job_record
    from vlmrun.run.outcome import RunOutcome
    from vlmrun.run.state import State

    rd = RunDirectory(argv[1])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    ignore_stop_signals()
    attempt = job_record.begin_attempt(rd, os.environ["SLURM_JOB_ID"], restart)
    (rd.path / f"restart-{restart}.env").write_text(json.dumps({"job": os.environ["SLURM_JOB_ID"], "restart": restart}))
    if restart >= 1:
        job_record.end_attempt(rd, attempt, RunOutcome(State.COMPLETED, last_step=2, reason="resumed and finished"))
        return 0
    stop = StopFlag().install()
    (rd.path / "ready").touch()
    if not stop.wait(300):
        job_record.fail_attempt(rd, attempt, "no stop signal came")
        return 1
    job_record.end_attempt(
        rd,
        attempt,
        RunOutcome(
            State.STOPPED,
            last_step=1,
            stop_signal=stop.signal_name,
            reason=f"stop requested ({stop.signal_name}); checkpointed at step 1",
        ),
    )
    return 3


def stuck_main(argv: list[str]) -> int:
    """Begins its attempt and never ends it: SIGTERM (scancel) does not stop it, only a kill does."""
    import signal as signals

    from vlmrun.run import job as job_record

    signals.signal(signals.SIGTERM, signals.SIG_IGN)
    rd = RunDirectory(argv[1])
    job_record.begin_attempt(rd, os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", 0)))
    (rd.path / "ready").touch()
    time.sleep(600)
    return 0


def ray_probe_main(argv: list[str]) -> int:
    from vlmrun.algorithms.common.stop import ignore_stop_signals
    from vlmrun.cluster.ray.allocation import probe_nodes, run_on_allocation

    ignore_stop_signals()
    rd = Path(argv[1])

    def probe(info):
        import psutil

        found = probe_nodes(info)
        found["processes"] = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        return found

    out = run_on_allocation(probe, rd / "ray", deadline_s=90)
    if out is not None:
        (rd / "probe.json").write_text(json.dumps(out))
    return 0


def never_join_main(argv: list[str]) -> int:
    """Node 0 brings Ray up; node 1 never joins (its entrypoint hangs)."""
    from vlmrun.cluster.ray.allocation import RayBringUpError, probe_nodes, run_on_allocation

    rd = Path(argv[1])
    if os.environ["SLURM_NODEID"] != "0":
        (rd / "hung.pid").write_text(str(os.getpid()))
        time.sleep(3600)
    try:
        run_on_allocation(probe_nodes, rd / "ray", deadline_s=20)
    except RayBringUpError as e:
        (rd / "error.txt").write_text(str(e))
        raise
    return 0


def node_dies_main(argv: list[str]) -> int:
    """Node 0 runs a long 'driver'; the test kills node 1's raylet while it runs."""
    from vlmrun.cluster.ray.allocation import RayNodeLost, run_on_allocation

    rd = Path(argv[1])

    def driver(info):
        (rd / "driver.started").touch()
        for _ in range(1200):  # a driver that polls, like run_controller's ray.wait loop
            time.sleep(0.25)

    try:
        run_on_allocation(driver, rd / "ray", deadline_s=90)
    except RayNodeLost as e:
        (rd / "error.txt").write_text(str(e))
        raise
    return 0


@pytest.fixture
def ray_temp_dirs():
    """Removes the Ray temp dirs that failed jobs keep for debugging (vlmrun-ray-<job>-<node>)."""
    job_ids = []
    yield job_ids
    for job_id in job_ids:
        for path in Path(tempfile.gettempdir()).glob(f"vlmrun-ray-{job_id}-*"):
            shutil.rmtree(path, ignore_errors=True)


def submit(rd: Path, r, main, *, wait: bool):
    return submit_slurm(RunDirectory(rd), r, wait=wait, entrypoint=NodeEntrypoint(str(rd), main), poll_s=0.5)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# ---------------------------------------------------------------- tests


def test_submit_runs_the_payload_and_records_the_job(cluster, tmp_path):
    t0 = time.monotonic()
    result = submit(tmp_path / "run", recipe(), complete_main, wait=True)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), (
        RunDirectory(tmp_path / "run").task_log(result.job_id).read_text()
    )
    job = read_job(RunDirectory(tmp_path / "run"))
    assert job.cluster == "slurm" and job.job_ids == [result.job_id] and job.submits[0].job_id == result.job_id
    st = launch_status.status(result.job_id)
    assert st["state"] == "COMPLETED" and st["run_dir"] == str(tmp_path / "run")
    lines = list(launch_logs.logs(result.job_id))
    assert lines[0].startswith(run_logs.ATTEMPT_MARKER) and any("payload ran on" in line for line in lines)
    print(f"submit -> completed: {time.monotonic() - t0:.1f}s")


def test_requeue_gives_same_job_id_and_restart_count_1(cluster, tmp_path):
    rd = RunDirectory(tmp_path / "run")
    result = submit(rd.path, recipe(), stop_then_complete_main, wait=False)
    wait_for(lambda: (rd.path / "ready").exists(), 60, "the payload to start")
    t0 = time.monotonic()
    assert control.requeue(result.job_id)["signalled"] == "SIGUSR2"
    final = wait_for_job(rd, result.job_id, poll_s=0.5)
    turnaround = time.monotonic() - t0
    assert (final.state, final.exit_code) == ("COMPLETED", 0)
    assert json.loads((rd.path / "restart-1.env").read_text()) == {"job": result.job_id, "restart": 1}
    job = read_job(rd)
    assert [(a.job_id, a.restart_count, a.state) for a in job.attempts] == [
        (result.job_id, 0, State.STOPPED),
        (result.job_id, 1, State.COMPLETED),
    ]
    assert job.attempts[0].requeue_cause == "requested" and job.attempts[0].stop_signal == "SIGUSR2"
    assert job.job_ids == [result.job_id]
    first, second = list(launch_logs.logs(str(rd.path), attempt=0)), list(launch_logs.logs(str(rd.path), attempt=1))
    assert "restart=0" in first[0] and "restart=1" in second[0]  # both attempts kept in submitit's appended log
    print(f"requeue -> restarted and completed: {turnaround:.1f}s")


@pytest.mark.parametrize(
    "wait_s,how",
    [
        (1.0, "killed by `vlmrun cancel` (scancel --signal=KILL): it was still in the queue 1 s after scancel"),
        (60.0, "ended without recording an outcome"),  # SLURM killed it itself, KillWait after scancel's SIGTERM
    ],
    ids=["cancel-kills", "slurm-kills"],
)
def test_a_job_that_cancel_could_not_stop_is_recorded_as_cancel_ended_it(cluster, tmp_path, wait_s, how):
    rd = RunDirectory(tmp_path / "run")
    result = submit(rd.path, recipe(), stuck_main, wait=False)
    wait_for(lambda: (rd.path / "ready").exists(), 60, "the payload to start")
    said = control.cancel(result.job_id, wait_s=wait_s, kill_wait_s=60)
    job = read_job(rd)
    assert not queries.is_live(result.job_id) and said["state"] == "KILLED" == job.state.value
    assert how in said["reason"] and "`vlmrun cancel`" in said["reason"] and "out of memory" not in said["reason"]
    assert job.attempts[-1].state is State.KILLED and job.attempts[-1].reason == said["reason"] == job.reason


def test_preemption_beyond_the_budget_ends_budget_exhausted(cluster, tmp_path):
    rd = RunDirectory(tmp_path / "run")
    result = submit(rd.path, recipe("checkpoint.requeue.preemptions=0"), stop_then_complete_main, wait=False)
    wait_for(lambda: (rd.path / "ready").exists(), 60, "the payload to start")
    subprocess.run(["scancel", "--signal=USR2", result.job_id], check=True)  # a preemption notice
    final = wait_for_job(rd, result.job_id, poll_s=0.5)
    job = read_job(rd)
    assert final.state == "BUDGET_EXHAUSTED" and final.exit_code == 3 and job.state is State.BUDGET_EXHAUSTED
    assert "checkpoint.requeue.preemptions=0" in job.reason and len(job.attempts) == 1


def test_ray_on_two_nodes(two_nodes, tmp_path):
    rd = tmp_path / "run"
    submit(rd, recipe("cluster.nodes=2", "cluster.cpus_per_node=2", "cluster.mem_gb=3"), ray_probe_main, wait=True)
    probe = json.loads((rd / "probe.json").read_text())
    assert probe["alive_nodes"] == 2
    ran_on = probe["ran_on"]
    assert sorted(v["slurm_node"] for v in ran_on.values()) == sorted(ran_on) and len(ran_on) == 2
    assert len({v["ip"] for v in ran_on.values()}) == 2 and not any(ip.startswith("127.") for ip in probe["addresses"])
    # the head's Ray: a raylet and a GCS, but no autoscaler monitor, API server or Ray Client server (nodes.py, start.py)
    head = "\n".join(probe["processes"])
    assert "raylet" in head and "gcs_server" in head and "autoscaler/_private/monitor.py" not in head, head
    assert "dashboard/dashboard.py" not in head and "ray.util.client.server" not in head, head
    print(f"Ray ready on 2 nodes: {probe['ready_s']}s")


def test_node_that_never_joins_fails_within_the_deadline_naming_it(two_nodes, tmp_path, ray_temp_dirs):
    rd = tmp_path / "run"
    r = recipe("cluster.nodes=2", "cluster.cpus_per_node=2", "cluster.mem_gb=3")
    result = submit(rd, r, never_join_main, wait=False)
    ray_temp_dirs.append(result.job_id)
    wait_for(lambda: (rd / "hung.pid").exists(), 60, "the job to start")
    t0 = time.monotonic()
    wait_for(lambda: not queries.is_live(result.job_id), 90, "the job to end")
    took = time.monotonic() - t0
    error = (rd / "error.txt").read_text()
    missing = [n["name"] for n in two_nodes][1]
    assert f"{missing} did not join (its node entrypoint never reported)" in error and "within 20s" in error
    assert took < 20 + 30, f"the job took {took:.0f}s to end after it started"
    leftovers = subprocess.run(
        ["pgrep", "-f", f"vlmrun-ray-{result.job_id}-|{rd}/submitit"], capture_output=True, text=True
    ).stdout.split()
    assert leftovers == [], f"processes of job {result.job_id} left: {leftovers}"
    print(f"never-joining node: job ended {took:.1f}s after it started")


def test_a_node_that_dies_fails_the_job_fast(two_nodes, tmp_path, ray_temp_dirs):
    rd = tmp_path / "run"
    r = recipe("cluster.nodes=2", "cluster.cpus_per_node=2", "cluster.mem_gb=3")
    result = submit(rd, r, node_dies_main, wait=False)
    ray_temp_dirs.append(result.job_id)
    wait_for(lambda: (rd / "driver.started").exists(), 90, "the driver to start")
    worker = [n["name"] for n in two_nodes][1]
    pattern = f"raylet.*vlmrun-ray-{result.job_id}-{worker}/"
    [pid] = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    t0 = time.monotonic()
    os.kill(int(pid), 9)  # the raylet this job started on the worker node
    wait_for(lambda: not queries.is_live(result.job_id), 60, "the job to end")
    took = time.monotonic() - t0
    error = (rd / "error.txt").read_text()
    assert worker in error, error
    assert took < 30, f"the job took {took:.0f}s to fail after the node died"
    print(f"node died -> job ended in {took:.1f}s: {error}")


@pytest.mark.slow
def test_real_time_limit_requeues_by_itself(cluster, tmp_path):
    """--time=2 with USR2 60 s before: SLURM's own signal stops the attempt, the job requeues once."""
    rd = RunDirectory(tmp_path / "run")
    r = recipe("cluster.time_limit=2", "cluster.signal_delay_s=60", "checkpoint.requeue.timeouts=1")
    result = submit(rd.path, r, stop_then_complete_main, wait=True)
    job = read_job(rd)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), job
    assert [a.restart_count for a in job.attempts] == [0, 1]
    assert job.attempts[0].requeue_cause == "timeout" and job.attempts[0].stop_signal == "SIGUSR2"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_ready_bench_on_two_nodes(two_nodes, tmp_path):
    """tools/slurm/ray_ready_bench.sbatch (one round) prints its two JSON rows."""
    out = tmp_path / "bench.out"
    env = os.environ | {"VENV": str(Path(sys.executable).parents[1]), "ROUNDS": "1", "BENCH_DIR": str(tmp_path / "w")}
    try:
        proc = subprocess.run(
            ["sbatch", "--wait", "--parsable", "-o", str(out), "tools/slurm/ray_ready_bench.sbatch"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    except subprocess.TimeoutExpired as e:  # the job must not outlive the test: it would hold both nodes
        job_id = (e.stdout or b"").decode().strip().split(";")[0]
        state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        subprocess.run(["scancel", job_id], check=False)
        logs = {p.name: p.read_text()[-1500:] for p in (tmp_path / "w").glob("*.log")}
        raise AssertionError(f"the bench job {job_id} ran past 400 s:\n{state}\n{logs}") from None
    assert proc.returncode == 0, (proc.stderr, out.read_text()[-3000:] if out.exists() else "")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert [r["kind"] for r in rows] == ["bare ray start", "vlmrun"]
    assert all(r["ready_s"] > 0 for r in rows) and rows[1]["inside_ray_head_s"] > 0
