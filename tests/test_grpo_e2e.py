"""Sync GRPO end to end on the tiny recipe: real Ray, real Energon, the real tiny Qwen2.5-VL, via the CLI.

The policy starts from the session's SFT baseline exported with `vlmrun export` (a random model earns
almost no reward): a recipe starts from an export through `model.path`. The uninterrupted run
(`grpo_want`, the local plane) keeps the ratio at exactly 1 with one inner step and writes GRPO's row
contract; two inner steps move it off 1 and the KL penalty sees the reference.

On every data-plane setting (the local plane, TransferQueue with its simple storage and with Mooncake,
and none: every field through the driver) a killed run resumed with `vlmrun resume` equals the
uninterrupted run at every step: every setting gives the same numbers and every kill resumes exactly.
A SIGKILLed server of the job's plane (storage unit, TransferQueue controller, mooncake_master) fails
the attempt within 30 s with one line naming it; a node SIGKILLed, alone or with its reaper, leaves no
process and no temp root behind; nothing of it is noise on the console or in the attempt's log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import time
from pathlib import Path

import pytest
from shared_runs import GRPO_STEPS, submit
from vlmrun_cli import (
    GRPO,
    Launcher,
    alive,
    census,
    job,
    last_step,
    node_pid,
    reaper_of,
    sealed,
    sets,
    states,
    vlmrun,
    wait_for,
)

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAME = (
    *("loss", "grad_norm", "lr", "valid_tokens", "sample_ids", "reward", "advantage_mean"),
    *("token_mult_prob_error", "probs_ratio_min", "probs_ratio_max", "accuracy"),
)
#: Keys every GRPO row carries: the run contract's and GRPO's own (metrics.py)
ROW_KEYS = """step attempt consumed_samples step_time_s loader_latency_max_s peak_rss_mb accuracy
kl gen_kl_error sampling_importance_ratio advantage_min advantage_max response_length_mean time_generation_s
time_refit_s time_logprob_s time_advantage_s time_train_s time_data_plane_s plane_bytes val_accuracy""".split()


def test_one_inner_step_keeps_the_ratio_at_one_and_rows_carry_the_contract(grpo_want):
    rows = history(grpo_want / "metrics.jsonl")
    for row in rows.values():
        assert row["probs_ratio_min"] == 1.0 == row["probs_ratio_max"]
        assert len(row["sample_ids"]) == 8 and row["valid_tokens"] > 0 and row["grad_norm"] > 0
        assert row["plane_bytes"] > 0  # the local plane moved the rollout
    assert statistics.median(r["token_mult_prob_error"] for r in rows.values()) < 1.05
    row = rows[3]  # a validation step
    for key in ROW_KEYS:
        assert key in row, key
    assert any(k.startswith("accuracy/") for k in row) and row["consumed_samples"] == 24
    assert sum(r["reward"] for r in rows.values()) > 0  # the exported SFT policy earns rewards


def test_a_recipe_starts_from_an_export(grpo_want, grpo_sets):
    assert not (grpo_want / "cache" / "models").exists()  # no tiny model was built: the run used the export
    dry = vlmrun("submit", GRPO, "--dry-run", "--cluster", "local", "--json", *grpo_sets, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "tiny: false" in json.loads(dry.stdout)["recipe"]


def test_two_inner_steps_move_the_ratio_off_one_and_the_kl_penalty_sees_it(tmp_path, grpo_sets):
    two = sets("train.max_steps=2", "grpo.inner_steps=2", "grpo.kl_coef=0.05", "train.val_samples=0", "parallel.dp=1")
    rows = history(submit(tmp_path / "inner", *grpo_sets, *two, recipe=GRPO) / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    assert all(r["probs_ratio_min"] < 1.0 < r["probs_ratio_max"] for r in rows.values())
    assert all(r["kl"] > 0 for r in rows.values())  # the reference logprobs went through the plane


# ---------------------------------------------------------------- killed: the job's own servers, its node

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


def needs_mooncake() -> None:
    from vlmrun.cluster.mooncake import mooncake_unavailable

    if mooncake_unavailable():
        pytest.skip(mooncake_unavailable())


def kill_mid_step(folder: Path, run: Path, args: list[str], victim: str) -> dict:
    """`vlmrun ARGS --wait`; once the attempt sealed a checkpoint 2 steps past the run's last step,
    SIGKILL `victim` ("storage unit", "controller", "mooncake_master", "node+reaper" or "node"). What
    was seen: victims, exit code, seconds from the kill to the launcher's end (`ended_s`) and to the
    last process of the attempt and its temp root gone (`gone_s`)."""
    target = last_step(run) + 2
    launcher = Launcher(folder, *args, "--wait", name=f"attempt-{len(list(folder.glob('attempt-*.err')))}")
    try:
        node = node_pid(run)
        marker, temp_root, reaper = reaper_of(node)
        wait_for(lambda: any(s >= target for s in sealed(run)), 300, f"a checkpoint at step {target}")
        seen = census(marker)
        if victim in ("node+reaper", "node"):
            victims = [node, reaper][: 2 if victim == "node+reaper" else 1]
        else:
            name = PROCESS.get(victim, victim)
            victims = [p for p, n in seen.items() if n.startswith(name)]
        assert len(victims) == (2 if victim == "node+reaper" else 1), (victim, seen)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = launcher.proc.wait(timeout=120)
        ended_s = time.monotonic() - t0
        wait_for(lambda: not alive(seen) and not temp_root.exists(), ended_s + GONE_S, "the attempt's end")
        gone_s = time.monotonic() - t0
    finally:
        launcher.kill_group()
    attempt = job(run)["attempts"][-1]
    return dict(
        victims=victims, census=seen, code=code, ended_s=ended_s, gone_s=gone_s, attempt=attempt, err=launcher.stderr()
    )


def assert_failed_naming(seen: dict, victim: str) -> None:
    """The attempt ended FAILED within 30 s, its reason one line naming the server, said once and quietly."""
    a, err = seen["attempt"], seen["err"]
    print(f"{victim} SIGKILLed: attempt FAILED {seen['ended_s']:.1f}s later: {a['reason']}")
    assert seen["code"] == 1 and a["state"] == "FAILED" and seen["ended_s"] < 30, (seen, err[-3000:])
    assert re.match(NAMED[victim].format(pid=seen["victims"][0]) + "; `vlmrun resume` continues", a["reason"]), a
    assert err.count(a["reason"]) == 1 and "\n" not in a["reason"], err[-3000:]
    assert not NOISE.search(err), NOISE.search(err)
    assert seen["gone_s"] < seen["ended_s"] + GONE_S


def assert_killed_and_gone(seen: dict, must_have: tuple[str, ...]) -> None:
    names = sorted(seen["census"].values())
    print(f"{seen['victims']} SIGKILLed: {len(names)} processes gone in {seen['gone_s']:.2f}s: {names}")
    for name in must_have:
        assert any(n.startswith(name) for n in names), (name, names)
    assert seen["gone_s"] < GONE_S and seen["attempt"]["state"] == "KILLED"
    assert "Traceback" not in seen["err"], seen["err"][-3000:]


def assert_resumes_to_the_numbers_of(run: Path, want: Path, driver: bool = False) -> None:
    """`vlmrun resume` ends the run quietly, every step equal to the uninterrupted run's."""
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0 and not NOISE.search(out.stderr), out.stderr[-3000:]
    got, expected = history(run / "metrics.jsonl"), history(want / "metrics.jsonl")
    assert sorted(got) == sorted(expected) == list(range(1, GRPO_STEPS + 1))
    for step in expected:
        for key in SAME:
            assert got[step][key] == expected[step][key], (step, key)
        assert (got[step]["plane_bytes"] == 0) == driver, step  # the plane moved every rollout, or none did
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert {p.name for p in (checkpoint / "generation").iterdir()} == {"replica_0.pt", "replica_1.pt"}
    for log in (run / "logs").glob("attempt-*.log"):
        if ".third-party." not in log.name:
            assert not NOISE.search(log.read_text()), (log, NOISE.search(log.read_text()))


def third_party_chatter(run: Path, attempt: int) -> int:
    """Mooncake's "metadata not found" lines filed in the attempt's third-party log (made at the first)."""
    log = run / "logs" / f"attempt-{attempt}.third-party.log"
    return log.read_text().count("metadata not found") if log.is_file() else 0


CHAINS = {  # (plane, the first attempt's victim, the resumed attempt's victim)
    "simple": ("simple", "storage unit", "controller"),
    "mooncake": ("mooncake", "mooncake_master", "node+reaper"),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_dead_plane_servers_fail_the_attempt_naming_them_and_resume_matches(tmp_path, grpo_sets, grpo_want, chain):
    backend, first, second = CHAINS[chain]
    if backend == "mooncake":
        needs_mooncake()
    run = tmp_path / "run"
    plane = sets("data_plane.impl=transfer_queue", f"data_plane.backend={backend}")
    submit_args = ["submit", GRPO, "--cluster", "local", "--run-dir", str(run), *grpo_sets, *plane]
    assert_failed_naming(kill_mid_step(tmp_path, run, submit_args, first), first)
    assert (third_party_chatter(run, 0) > 0) == (backend == "mooncake")  # Mooncake's chatter (every client's), filed
    seen = kill_mid_step(tmp_path, run, ["resume", str(run)], second)
    if second == "node+reaper":
        assert_killed_and_gone(seen, ("mooncake_master", "raylet", "ray::TransferQueueController"))
    else:
        assert_failed_naming(seen, second)
    assert_resumes_to_the_numbers_of(run, grpo_want)
    assert states(run) == ["FAILED", "KILLED" if second == "node+reaper" else "FAILED", "COMPLETED"]


@pytest.mark.parametrize("plane", ["local", "driver"])
def test_a_sigkilled_node_leaves_nothing_behind_and_resume_matches(tmp_path, grpo_sets, grpo_want, plane):
    """The process-local plane (the recipe's), and none (every field through the driver, whose
    controller holds the loader shards): SIGKILL of the node, then `vlmrun resume`. The local one
    also moves the policy to host memory and back around every rollout
    (parallel.offload_during_generation): the numbers are the run's without."""
    run = tmp_path / "run"
    local = ["data_plane.impl=local", "parallel.offload_during_generation=true"]
    setting = sets(*local) if plane == "local" else sets("data_plane.enabled=false")
    submit_args = ["submit", GRPO, "--cluster", "local", "--run-dir", str(run), *grpo_sets, *setting]
    seen = kill_mid_step(tmp_path, run, submit_args, "node")
    assert_killed_and_gone(seen, ("raylet", "ray::GrpoWorker"))
    assert_resumes_to_the_numbers_of(run, grpo_want, driver=plane == "driver")
    assert states(run) == ["KILLED", "COMPLETED"]
