"""status / logs / cancel / requeue without a cluster: parsers on fixture strings, the registry, local runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest

from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.launch import control, targets
from vlmrun.launch import logs as launch_logs
from vlmrun.launch import registry as job_registry
from vlmrun.launch import status as launch_status
from vlmrun.launch.slurm import executor as slurm_executor
from vlmrun.launch.slurm import preflight, queries
from vlmrun.run import logs as run_logs
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import add_job, begin_attempt, read_job, write_job
from vlmrun.run.state import State

ROOT = Path(__file__).resolve().parents[1]

SQUEUE = "41|RUNNING|None|1:02|30:00|vm\n42|PENDING|BeginTime|0:00|30:00|\n"
SCONTROL_JOB = (
    "JobId=43 JobName=tiny-clevr-cpu UserId=root(0) JobState=COMPLETED Reason=None Dependency=(null) "
    "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0 RunTime=00:00:41 TimeLimit=00:30:00 "
    "Command=/runs/a b/submitit/43_submission.sh StdOut=/runs/a b/submitit/43_0_log.out\n"
)
SACCT = "44|CANCELLED by 0|0:15|00:01:10\n45|TIMEOUT|0:0|00:30:00\n"
SINFO = (
    "n1|debug*|2|21695|(null)|infinite\nn2|debug*|2|21695|(null)|infinite\n"
    "g1|gpu|64|512000|gpu:a100:8(S:0-1)|2-00:00:00\ng2|gpu|64|512000|gpu:a100:4(S:0),gpu:v100:4|2-00:00:00\n"
)


def test_parse_squeue():
    rows = queries.parse_squeue(SQUEUE)
    assert rows["41"] == {"state": "RUNNING", "reason": "None", "elapsed": "1:02", "time_limit": "30:00", "nodes": "vm"}
    assert rows["42"]["state"] == "PENDING" and rows["42"]["reason"] == "BeginTime"


def test_parse_scontrol_job_keeps_values_with_spaces():
    info = queries.parse_scontrol_job(SCONTROL_JOB)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["ExitCode"] == "0:0"
    assert info["StdOut"] == "/runs/a b/submitit/43_0_log.out"


def test_parse_sacct_and_no_accounting():
    rows = queries.parse_sacct(SACCT)
    assert rows["44"]["state"] == "CANCELLED" and rows["45"]["state"] == "TIMEOUT"
    assert queries.parse_sacct("Slurm accounting storage is disabled\n") == {}


def fake_tools(outputs: dict[str, tuple[int, str, str]]):
    """Patch run_tool: the first word after the command name picks the canned answer."""

    def run(cmd, timeout=30):
        return outputs.get(cmd[0], (127, "", f"{cmd[0]}: not found"))

    return mock.patch.object(queries, "run_tool", side_effect=run)


def test_slurm_state_falls_back_from_squeue_to_scontrol_to_sacct():
    with fake_tools({"squeue": (0, SQUEUE, "")}):
        assert queries.slurm_state("41")["source"] == "squeue"
    with fake_tools({"squeue": (0, "", ""), "scontrol": (0, SCONTROL_JOB, "")}):
        s = queries.slurm_state("43")
        assert s["state"] == "COMPLETED" and s["restarts"] == 1 and s["source"] == "scontrol"
    with fake_tools(
        {"squeue": (1, "", "Invalid job id"), "scontrol": (1, "", "Invalid job id"), "sacct": (0, SACCT, "")}
    ):
        assert queries.slurm_state("45") == {
            "state": "TIMEOUT",
            "exit_code": "0:0",
            "elapsed": "00:30:00",
            "source": "sacct",
        }
    with fake_tools({"sacct": (0, "Slurm accounting storage is disabled\n", "")}):
        assert queries.slurm_state("46") is None


@pytest.mark.parametrize(
    "recorded,slurm_state,expected",
    [
        (State.PENDING, {"state": "PENDING"}, "PENDING"),
        (State.REQUEUED, {"state": "PENDING"}, "PENDING"),
        (State.RUNNING, {"state": "RUNNING"}, "RUNNING"),
        (State.COMPLETED, {"state": "COMPLETED"}, "COMPLETED"),
        (State.COMPLETED, None, "COMPLETED"),
        (State.BUDGET_EXHAUSTED, {"state": "COMPLETED"}, "BUDGET_EXHAUSTED"),
        (State.RUNNING, {"state": "TIMEOUT"}, "TIMEOUT"),
        (State.RUNNING, None, "FAILED"),
        (State.RUNNING, {"state": "COMPLETED"}, "FAILED"),
        (None, None, "FAILED"),
    ],
)
def test_combined_state(recorded, slurm_state, expected):
    assert slurm_executor.combined_state(recorded, slurm_state) == expected


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRUN_JOBS_DIR", str(tmp_path / "registry"))
    return tmp_path / "registry"


def make_run(tmp_path: Path, cluster="slurm", job_id="41") -> RunDirectory:
    rd = RunDirectory(tmp_path / "run")
    rd.create(load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml"))
    add_job(rd, job_id, cluster, "tiny")
    return rd


def test_find_run_by_dir_registry_and_scontrol(tmp_path, registry):
    rd = make_run(tmp_path)
    found, job_id = targets.find_run(str(rd.path))
    assert found.path == rd.path and job_id == "41"
    job_registry.register_job("41", rd.path)
    found, job_id = targets.find_run("41")
    assert found.path == rd.path and job_id == "41"
    out = SCONTROL_JOB.replace("/runs/a b", str(rd.path))
    with fake_tools({"scontrol": (0, out, "")}):
        found, job_id = targets.find_run("43")
    assert found.path == rd.path and job_id == "43"
    with fake_tools({}), pytest.raises(InputError) as e:
        targets.find_run("99")
    assert "99" in str(e.value) and "registry" in str(e.value)


def test_status_reads_lineage_and_metrics(tmp_path, registry):
    rd = make_run(tmp_path)
    job_registry.register_job("41", rd.path)
    with mock.patch.dict(os.environ, {"SLURM_JOB_ID": "41"}):
        begin_attempt(rd, "41", 0)
        begin_attempt(rd, "41", 1)
    rd.metrics_file().write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s, "attempt": 0}) + "\n" for s in (1, 2, 3))
    )
    with fake_tools({"squeue": (0, SQUEUE, "")}):
        st = launch_status.status("41")
    assert st["state"] == "RUNNING" and st["restarts"] == 1 and st["attempts"] == 2
    assert st["last_step"] == 3 and st["loss"] == pytest.approx(1 / 3)
    assert set(st) == {
        "run_dir",
        "cluster",
        "job_id",
        "job_ids",
        "recorded_state",
        "reason",
        "attempts",
        "restarts",
        "requeues",
        "last_step",
        "loss",
        "slurm",
        "state",
    }  # what scripts read from `status --json`
    assert st["recorded_state"] == "RUNNING" and st["job_ids"] == ["41"]
    assert st["requeues"] == {"timeout": 0, "preemption": 0, "requested": 0}
    json.dumps(st)  # plain JSON
    with fake_tools({"squeue": (0, SQUEUE, "")}):
        assert [j["job_id"] for j in launch_status.status(None)["jobs"]] == ["41"]


def test_local_jobs_whose_nodes_got_one_pid_after_a_wrap_keep_apart(tmp_path, registry):
    """The pids wrapped between two local runs: their nodes had one pid, not one start time; each job id
    still names its own run."""
    from vlmrun.run.process import local_job_id

    runs = {}
    for n, started in enumerate((1000, 987654)):  # the node's start time, in clock ticks since boot
        job_id = local_job_id(4242, started)
        rd = RunDirectory(tmp_path / f"run-{n}")
        rd.create(load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml"))
        add_job(rd, job_id, "local", "tiny")
        job_registry.register_job(job_id, rd.path)
        runs[job_id] = rd
    assert len(runs) == 2 and all(job_id.startswith("local-4242-") for job_id in runs)
    for job_id, rd in runs.items():
        found, named = targets.find_run(job_id)
        assert found.path == rd.path and named == job_id


def test_status_of_a_local_run_checks_the_pid(tmp_path, registry):
    rd = make_run(tmp_path, cluster="local", job_id="local-1")
    begin_attempt(rd, "local-1", 0, pid=os.getpid())
    st = launch_status.status(str(rd.path))
    assert st["state"] == "RUNNING" and st["pid"] == os.getpid()
    job = read_job(rd)
    job.attempts[0].pid = 2**22 + 12345  # no such process
    write_job(rd, job)
    st = launch_status.status(str(rd.path))
    assert st["state"] == "KILLED" and "without recording an outcome" in st["reason"]


def test_attempt_slices_by_restart_marker():
    lines = [
        "submitit INFO starting",
        f"{run_logs.ATTEMPT_MARKER} job=41 restart=0 node=vm rank=0/1 time=t <==",
        "a0",
        "a1",
        f"{run_logs.ATTEMPT_MARKER} job=41 restart=1 node=vm rank=0/1 time=t <==",
        "b0",
    ]
    assert list(run_logs.attempt_slice(lines, "41", 0))[1:] == ["a0", "a1"]
    assert list(run_logs.attempt_slice(lines, "41", 1))[1:] == ["b0"]
    assert list(run_logs.attempt_slice(lines, "41", 2)) == []


def test_logs_picks_the_attempt(tmp_path, registry):
    rd = make_run(tmp_path)
    with mock.patch.dict(os.environ, {"SLURM_JOB_ID": "41"}):
        begin_attempt(rd, "41", 0)
        begin_attempt(rd, "41", 1)
    log = rd.task_log("41")
    log.parent.mkdir(parents=True)
    log.write_text(
        f"{run_logs.ATTEMPT_MARKER} job=41 restart=0 x <==\nfirst\n{run_logs.ATTEMPT_MARKER} job=41 restart=1 x <==\nsecond\n"
    )
    assert list(launch_logs.logs(str(rd.path), attempt=0))[1:] == ["first"]
    assert list(launch_logs.logs(str(rd.path)))[1:] == ["second"]
    with pytest.raises(InputError) as e:
        list(launch_logs.logs(str(rd.path), attempt=5))
    assert "--attempt" in str(e.value) and "0..1" in str(e.value)


def test_requeue_and_cancel_of_a_local_run_signal_the_pid(tmp_path, registry):
    code = (
        "import signal,sys,time\nsignal.signal(signal.SIGUSR2, lambda *a: (print('usr2', flush=True)))\n"
        "print('ready', flush=True)\nwhile True: time.sleep(0.1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        rd = make_run(tmp_path, cluster="local", job_id=f"local-{proc.pid}")
        begin_attempt(rd, f"local-{proc.pid}", 0, pid=proc.pid)
        assert control.requeue(str(rd.path))["signalled"] == "SIGUSR2"
        assert proc.stdout.readline().strip() == "usr2"
        # it dies of the SIGTERM without recording an outcome: cancel says so (a real node checkpoints)
        assert control.cancel(str(rd.path), wait_s=10)["state"] == "KILLED"
        assert proc.wait(timeout=10) == -signal.SIGTERM
        job = read_job(rd)
        assert job.state is State.KILLED and job.attempts[0].state is State.KILLED
    finally:
        proc.kill()


def test_requeue_refuses_a_job_that_is_not_running(tmp_path, registry):
    rd = make_run(tmp_path)
    with fake_tools({"squeue": (0, SQUEUE.replace("41|RUNNING", "41|PENDING"), "")}), pytest.raises(InputError) as e:
        control.requeue(str(rd.path))
    assert "PENDING" in str(e.value)
    assert not (rd.path / "REQUEUE_REQUESTED").exists()


# ---------------------------------------------------------------- fits the partition (sinfo fixtures)


def test_parse_sinfo_gres_and_limits():
    rows = {r["node"]: r for r in queries.parse_sinfo(SINFO)}
    assert rows["n1"]["default"] and rows["n1"]["partition"] == "debug" and rows["n1"]["max_minutes"] is None
    assert rows["g1"]["gpus"] == 8 and rows["g2"]["gpus"] == 8 and rows["g1"]["max_minutes"] == 2880
    assert queries.parse_limit("4:00:00") == 240 and queries.parse_limit("30:00") == 30


@pytest.mark.parametrize(
    "sets,field",
    [
        (["cluster.nodes=3"], "cluster.nodes"),
        (["cluster.cpus_per_node=4"], "cluster.cpus_per_node"),
        (["cluster.mem_gb=64"], "cluster.mem_gb"),
        (["cluster.time_limit=3000", "cluster.partition=gpu"], "cluster.time_limit"),
    ],
)
def test_misfits_name_the_field(sets, field):
    recipe = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", sets)
    rows = queries.parse_sinfo(SINFO)
    part = recipe.cluster.partition or "debug"
    with pytest.raises(InputError) as e:
        preflight.check_fits(recipe, [r for r in rows if r["partition"] == part])
    assert field in str(e.value)


def test_gpus_per_node_must_fit():
    recipe = load_recipe(
        ROOT / "recipes" / "omni-clevr-1n8g.yaml",
        [
            "cluster.partition=gpu",
            "cluster.nodes=2",
            "parallel.dp=16",
            "cluster.mem_gb=400",
            "train.global_batch_size=128",
        ],
    )
    rows = [r for r in queries.parse_sinfo(SINFO) if r["partition"] == "gpu"]
    preflight.check_fits(recipe, rows)
    rows[1]["gpus"] = 4
    with pytest.raises(InputError) as e:
        preflight.check_fits(recipe, rows)
    assert "cluster.gpus_per_node" in str(e.value)


def test_multi_node_needs_own_addresses_and_a_shared_run_dir():
    nodes = [{"node": "n1", "addr": "127.0.0.1", "host": "vm"}, {"node": "n2", "addr": "127.0.0.1", "host": "vm"}]
    with pytest.raises(InputError) as e:
        preflight.check_nodes_see_run_dir(Path("/shared/run"), 2, nodes)
    assert "SLURM_NETNS=1" in str(e.value)
    nodes = [{"node": "n1", "addr": "10.0.0.1", "host": "a"}, {"node": "n2", "addr": "10.0.0.2", "host": "b"}]
    assert preflight.check_nodes_see_run_dir(Path("/shared/run"), 2, nodes) == []
    with pytest.raises(InputError) as e:
        preflight.check_nodes_see_run_dir(Path("/tmp/run"), 2, nodes)
    assert "--run-dir" in str(e.value)
    with mock.patch.object(preflight, "_short_hostname", return_value="a"):
        local = [dict(n, host="a") for n in nodes]
        [warning] = preflight.check_nodes_see_run_dir(Path("/tmp/run"), 2, local)
    assert "every node of this cluster runs on this machine" in warning
    assert preflight.check_nodes_see_run_dir(Path("/tmp/run"), 1, nodes) == []


def test_missing_sbatch_is_bad_input(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
    with mock.patch.object(preflight.shutil, "which", return_value=None), pytest.raises(InputError) as e:
        preflight.preflight(tmp_path, recipe)
    assert "sbatch" in str(e.value) and e.value.exit_code == 2


def test_dry_run_submits_nothing(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
    rd = RunDirectory(tmp_path / "never")
    with mock.patch("vlmrun.cluster.submitit_api.submit_held", side_effect=AssertionError("submitted")):
        result = slurm_executor.SlurmExecutor().dry_run(rd, recipe)
    assert result.dry_run and result.script.startswith("#!/bin/bash") and not rd.path.exists()
    assert "name: tiny-clevr-cpu" in result.rendered


# ---------------------------------------------------------------- what status and cancel say


STUCK_NODE = """
import os, signal, sys, time
from vlmrun.cluster.reaper import AttemptScope
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import Holder, RunLock

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a node stuck in a step: SIGTERM does not end it
rd, job_id = RunDirectory(sys.argv[1]), f"local-{os.getpid()}"
lock = RunLock.acquire(rd.path)
lock.describe(Holder.of(os.getpid(), job_id))
job_record.add_job(rd, job_id, "local", "stuck")
scope = AttemptScope.open()
scope.start_reaper(run_dir=rd.path, job_id=job_id)  # as the node does: it records a kill it finds
scope.enter()
job_record.begin_attempt(rd, job_id, 0)
print(scope.marker, flush=True)
time.sleep(300)
"""


def test_a_cancel_that_had_to_kill_is_recorded_as_its_kill(tmp_path, registry):
    rd = RunDirectory(tmp_path / "run")
    rd.create(load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml"))
    node = subprocess.Popen([sys.executable, "-c", STUCK_NODE, str(rd.path)], stdout=subprocess.PIPE, text=True)
    try:
        marker = node.stdout.readline().strip()
        said = control.cancel(str(rd.path), wait_s=1.0, kill_wait_s=10)
        assert node.wait(timeout=10) == -signal.SIGKILL
    finally:
        node.kill()
    deadline = time.monotonic() + 20  # the node's reaper records the kill it finds, too: let it finish
    while any(marker in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
        assert time.monotonic() < deadline, "the reaper did not end"
        time.sleep(0.1)
    job = read_job(rd)
    why = "killed by `vlmrun cancel` (SIGKILL): it had not ended 1 s after SIGTERM"
    assert said["state"] == "KILLED" and said["reason"] == why
    assert (job.state, job.reason, job.attempts[0].state, job.attempts[0].reason) == (
        State.KILLED,
        why,
        State.KILLED,
        why,
    )
    assert "out of memory" not in launch_status.status(str(rd.path))["reason"]


def test_each_attempt_says_its_own_state_and_reason(tmp_path, registry):
    """A new attempt (or a job submitted, waiting) does not show the previous attempt's reason."""
    from vlmrun.run.job import end_attempt
    from vlmrun.run.outcome import RunOutcome

    rd = make_run(tmp_path, cluster="local", job_id="local-1")
    first = begin_attempt(rd, "local-1", 0, pid=os.getpid())
    end_attempt(
        rd, first, RunOutcome(State.STOPPED, last_step=4, reason="stop requested (SIGUSR2); checkpointed at step 4")
    )
    add_job(rd, "local-2", "local", "tiny")
    st = launch_status.status(str(rd.path))
    assert st["state"] == "PENDING" and "job local-2 submitted" in st["reason"] and "step 4" not in st["reason"]
    second = begin_attempt(rd, "local-2", 0, pid=os.getpid())
    st = launch_status.status(str(rd.path))
    assert st["state"] == "RUNNING" and st["reason"].startswith(f"attempt {second} running since")
    job = read_job(rd)
    assert [(a.state, a.reason) for a in job.attempts] == [
        (State.STOPPED, "stop requested (SIGUSR2); checkpointed at step 4"),
        (State.RUNNING, None),
    ]
