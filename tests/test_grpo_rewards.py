"""GRPO with a reward function of the user's, through the CLI on the tiny recipe (real Ray, real Energon,
the tiny Qwen2.5-VL): a module outside the package, importable through PYTHONPATH, weighted beside a
built-in term; its named parts land in metrics.jsonl as reward/<name>/<key>; what it prints is in the
attempt log as on the console; when it raises, the run fails with one line naming the function and the
sample; a path that does not import is refused at submit (exit 2, naming grpo.rewards, nothing made). The terms' arithmetic, the built-ins and the other
refusals: tests/test_grpo_units.py."""

from __future__ import annotations

import os

import pytest
from vlmrun_cli import GRPO, job, sets, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow

#: 8 prompts x 4 responses a step over 2 replicas: each owner rank scores 16 responses a step.
#: One rank, which scores every response of a step: 8 prompts x 4.
SMALL = [
    *("train.global_batch_size=8", "grpo.num_generations=4", "train.val_samples=0", "train.max_steps=4"),
    "parallel.dp=1",
]
MODULE = '''
CALLS = 0


def length_bonus(response, sample, ended):
    """The user's reward: shorter answers earn more; named numbers are logged beside it."""
    global CALLS
    CALLS += 1
    if CALLS == 1:
        print("length_bonus: grading its first response", flush=True)
    if CALLS > 64:  # the third step (32 responses a step)
        raise SystemExit("the grader's cache is gone")  # any exception, even this one, names the function
    words = len(response.split())
    return {"reward": 1.0 / (1 + words), "words": words, "ended": float(ended)}
'''


def test_a_users_reward_trains_logs_its_parts_and_fails_the_run_naming_itself(tmp_path, run_data):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_rewards.py").write_text(MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "mine"), os.environ.get("PYTHONPATH", "")])}
    rewards = "grpo.rewards=[{fn: my_rewards:length_bonus, weight: 0.5, name: brief}, {fn: clevr_exact}]"
    run = tmp_path / "run"
    out = vlmrun(
        *("submit", GRPO, "--cluster", "local", "--run-dir", str(run), "--wait"),
        *run_data,
        *sets(*SMALL, rewards),
        env=env,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    rows = history(run / "metrics.jsonl")
    assert sorted(rows) == [1, 2]  # the third step failed in its reward stage
    for row in rows.values():
        assert 0 < row["reward/brief"] <= 1 and row["reward/brief/words"] >= 0 and 0 <= row["reward/brief/ended"] <= 1
        assert row["reward/clevr_exact"] >= 0
        assert abs(row["reward"] - (0.5 * row["reward/brief"] + row["reward/clevr_exact"])) < 1e-5
    reason = job(run)["attempts"][-1]["reason"]
    assert "\n" not in reason and "the reward function my_rewards:length_bonus (grpo.rewards), on sample " in reason
    assert "raised SystemExit: the grader's cache is gone" in reason
    assert reason in out.stderr
    # the attempt log holds what the console showed (with --wait too): the function's own print included
    logged = (run / "logs" / "attempt-0.log").read_text().splitlines()
    shown = [line for line in out.stderr.splitlines() if line.strip()]
    assert [line for line in shown if line not in logged] == [], out.stderr[-3000:]
    assert any(line.endswith("length_bonus: grading its first response") for line in logged)


@pytest.mark.parametrize(
    "module, words",
    [
        (None, "'not_a_module_here:score': importing not_a_module_here failed (ModuleNotFoundError"),
        ("raise SystemExit(0)\n", "'not_a_module_here:score': importing not_a_module_here failed (SystemExit: 0)"),
    ],
)
def test_a_reward_function_that_does_not_import_is_refused_at_submit(tmp_path, run_data, module, words):
    if module is not None:  # a module that exits while it is imported: submit must not exit 0 with it
        (tmp_path / "not_a_module_here.py").write_text(module)
    run = tmp_path / "run"
    out = vlmrun(
        *("submit", GRPO, "--cluster", "local", "--run-dir", str(run), "--dry-run"),
        *run_data,
        *sets(*SMALL, "grpo.rewards=[{fn: clevr_exact}, {fn: not_a_module_here:score}]"),
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith(f"error: grpo.rewards[1].fn: {words}")
    assert not run.exists()
