"""submitit's private API, which vlmrun uses through cluster/submitit_api.py only: each entry is named here,
so an installed submitit that lacks one or changed its signature fails this module, naming it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import submitit
from packaging.requirements import Requirement

from vlmrun.cluster import requeue, submitit_api
from vlmrun.config.train import RequeueBudget
from vlmrun.run.job import Attempt
from vlmrun.run.state import State

ROOT = Path(__file__).resolve().parents[1]
RELIED_ON = [  # what vlmrun calls, overrides or reads of submitit's private API (cluster/submitit_api.py)
    "submitit.core._submit",
    "submitit.core.job_environment._checkpoint",
    "submitit.core.job_environment.JobEnvironment._requeue",
    "submitit.core.utils.DelayedSubmission._timeout_countdown",
    "submitit.slurm.slurm.SlurmExecutor._make_submission_command",
    "submitit.slurm.slurm.SlurmExecutor._make_submission_file_text",
    "submitit.slurm.slurm.SlurmExecutor._submitit_command_str",
    "submitit.slurm.slurm.SlurmJobEnvironment._requeue",
]


def test_the_adapter_lists_exactly_what_vlmrun_relies_on():
    assert sorted(submitit_api.PRIVATE_API) == sorted(RELIED_ON)


@pytest.mark.parametrize("name", RELIED_ON)
def test_the_installed_submitit_has_it(name):
    assert submitit_api.api_problem(name) is None, f"{submitit.__version__}: {submitit_api.api_problem(name)}"


def test_a_missing_or_changed_api_is_named(monkeypatch):
    from submitit.core import job_environment
    from submitit.slurm import slurm

    monkeypatch.delattr(slurm.SlurmJobEnvironment, "_requeue")
    monkeypatch.setattr(job_environment, "_checkpoint", lambda delayed, path: "")
    monkeypatch.setattr(slurm.SlurmExecutor, "_submitit_command_str", "python -m x")
    problems = submitit_api.api_problems()
    assert problems == [
        "submitit.core.job_environment._checkpoint: signature (delayed, path), vlmrun expects (delayed, filepath, countdown)",
        "submitit.slurm.slurm.SlurmExecutor._submitit_command_str: no longer a property (str)",
        "submitit.slurm.slurm.SlurmJobEnvironment._requeue: missing",
    ]
    with pytest.raises(submitit_api.SubmititChanged) as e:
        submitit_api.require_api()
    assert all(p in str(e.value) for p in problems) and e.value.exit_code == 1


def test_no_other_module_touches_submitit_private_names():
    """A module that imports submitit (or its adapter) uses no `x._name` but its own (self, cls): any
    other would be a private call of submitit's that the checks above do not see."""
    offenders = []
    for path in (ROOT / "vlmrun").rglob("*.py"):
        if path.name == "submitit_api.py" or not {"submitit", "submitit_api"} & _imported(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if ast.unparse(node.value) not in ("self", "cls"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def _imported(path: Path) -> set[str]:
    """The top-level packages and the module names a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {(node.module or "").split(".")[0], *(a.name for a in node.names)}
    return names


def test_the_pin_has_an_upper_bound_that_holds_the_tested_and_installed_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [Requirement(d) for d in deps if Requirement(d).name == "submitit"]
    assert any(spec.operator in ("<", "<=", "~=", "==") for spec in pin.specifier), f"unbounded: {pin}"
    tested = [
        line.split("==")[1]
        for line in (ROOT / "requirements/tested.txt").read_text().splitlines()
        if line.startswith("submitit==")
    ]
    assert tested and pin.specifier.contains(tested[0]) and pin.specifier.contains(submitit.__version__)


def test_submitit_counts_the_time_limit_requeues_job_json_says_are_left():
    """One budget: submitit's countdown is set from job.json's count (requeue.timeouts_left), never its own."""
    budget = RequeueBudget(timeouts=3, preemptions=1)
    attempts = [
        Attempt(attempt=0, job_id="7", state=State.STOPPED, requeue_cause="timeout"),
        Attempt(attempt=1, job_id="7", state=State.STOPPED, requeue_cause="preemption"),
        Attempt(attempt=2, job_id="6", state=State.STOPPED, requeue_cause="timeout"),  # another job id
    ]
    assert requeue.timeouts_left(attempts, "7", budget) == 2 and requeue.timeouts_left([], None, budget) == 3
    from vlmrun.config.load import load_recipe
    from vlmrun.launch.slurm.render import make_executor

    recipe = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", ["checkpoint.requeue.timeouts=3"])
    assert make_executor(Path("/r"), recipe, render_only=True).max_num_timeout == 3
