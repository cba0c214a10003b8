"""The CLI as a user meets it: help, dry runs, and bad input that exits 2 naming the field, no traceback."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from vlmrun_cli import ROOT, TINY, vlmrun


def test_help_lists_commands_and_imports_nothing_heavy():
    out = vlmrun("--help")
    assert out.returncode == 0
    for cmd in ("submit", "resume", "compare", "data"):
        assert cmd in out.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, vlmrun.cli; print(sorted(m for m in ('torch','ray','transformers','megatron.energon','megatron.core') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "[]"


def leaf_commands() -> dict[str, object]:
    """'submit', 'data clevr', ... -> its click command, for every command a user can run."""
    from typer.main import get_command

    from vlmrun.cli import app

    def walk(group, path):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                yield from walk(cmd, [*path, name])
            else:
                yield " ".join([*path, name]), cmd

    return dict(walk(get_command(app), []))


def examples(help_text: str) -> list[str]:
    """The example command lines of a docstring: `Example: vlmrun ...` or the lines under `Examples:`."""
    lines = [line.strip() for line in help_text.splitlines()]
    found = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Example:")]
    if "Examples:" in lines:
        found += [line for line in lines[lines.index("Examples:") + 1 :] if line.startswith("vlmrun ")]
    return found


def squeezed(text: str) -> str:
    return "".join(text.split())  # help output wraps long lines, sometimes inside a word at a hyphen


@pytest.mark.parametrize("path", sorted(leaf_commands()))
def test_each_command_help_teaches_it_by_example_and_documents_every_option(path):
    cmd = leaf_commands()[path]
    out = vlmrun(*path.split(), "--help")
    assert out.returncode == 0, out.stderr
    found = examples(cmd.help or "")
    assert found, f"`vlmrun {path} --help` shows no `Example: vlmrun {path} ...` line"
    for example in found:
        assert squeezed(example) in squeezed(out.stdout)
        words = shlex.split(example)
        assert words[: 1 + len(path.split())] == ["vlmrun", *path.split()], f"example runs another command: {example}"
        # the example parses as this command's arguments: every option it uses exists and takes its value
        cmd.make_context(f"vlmrun {path}", words[1 + len(path.split()) :])
    for param in cmd.params:
        name = param.opts[0] if param.param_type_name == "option" else param.name
        assert (param.help or "").strip(), f"`vlmrun {path} --help`: {name} has no help text"
        assert squeezed(param.help) in squeezed(out.stdout), f"{name}'s help text is not shown"


def test_dry_run_json_names_run_dir_and_starts_nothing(tmp_path):
    out = vlmrun(
        "submit",
        TINY,
        "--dry-run",
        "--cluster",
        "local",
        "--run-dir",
        str(tmp_path / "r"),
        "--json",
        "--set",
        "train.max_steps=5",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run_dir"] == str(tmp_path / "r") and data["dry_run"] is True
    assert "max_steps: 5" in data["recipe"]
    assert not (tmp_path / "r").exists()


def test_submit_says_when_train_epochs_caps_train_max_steps(tmp_path):
    """The issue's case: 62 samples, 8 a step at dp=2, train.epochs: 1 and --set train.max_steps=20."""
    odd = ["--set", f"data.path={tmp_path / 'none'}", "--set", "data.synthetic={train: 62, val: 8}"]
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", *odd, "--set", "train.max_steps=20")
    assert out.returncode == 0, out.stderr
    assert (
        "note: train.epochs: 1 caps train.max_steps=20 to 8 steps (8 per epoch over the 62 samples of the split); "
        "--set train.epochs=3 trains all 20"
    ) in out.stdout
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", *odd, "--set", "train.max_steps=20", "--json")
    assert json.loads(out.stdout)["steps"]["max_steps"] == 8
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", *odd, "--set", "train.max_steps=8")
    assert out.returncode == 0 and "caps" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "args, field",
    [
        (["--set", "train.lr=abc"], "train.lr"),
        (["--set", "no_such_section.x=1"], "no_such_section"),
        (["--set", "train.max_steps=-5"], "train.max_steps"),
        (["--set", "name=$(touch /tmp/vlmrun-pwned)"], "name"),
        (["--set", "cluster.job_name=`id`", "--set", "cluster.partition=a;b"], "cluster.partition"),
        (["--cluster", "moon"], "--cluster"),
        (["--set", "oops"], "--set"),
    ],
)
def test_bad_input_exits_2_naming_the_field(args, field):
    out = vlmrun("submit", TINY, "--dry-run", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert field in out.stderr
    assert 1 <= len(out.stderr.strip().splitlines()) <= 2
    assert not Path("/tmp/vlmrun-pwned").exists()


def test_missing_and_malformed_recipe_files(tmp_path):
    out = vlmrun("submit", str(tmp_path / "nope.yaml"), "--dry-run")
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n  model: : :\n")
    out = vlmrun("submit", str(bad), "--dry-run")
    assert out.returncode == 2 and "malformed YAML" in out.stderr and "Traceback" not in out.stderr


def test_unknown_option_is_bad_input():
    out = vlmrun("submit", TINY, "--no-such-flag")
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_submit_refuses_a_run_dir_that_holds_a_run(tmp_path):
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "vlmrun resume" in out.stderr


def test_resume_help_lists_every_setting_a_resume_may_change():
    from vlmrun.launch.resume import RESUMABLE

    shown = squeezed(vlmrun("resume", "--help").stdout)
    for field in RESUMABLE:
        assert squeezed(field) in shown, field


def test_resume_refuses_fingerprinted_override_before_starting(tmp_path):
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", "--json")
    assert out.returncode == 0
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "recipe.yaml").write_text(json.loads(out.stdout)["recipe"])
    out = vlmrun("resume", str(rd), "--set", "data.shuffle_buffer=8")
    assert out.returncode == 2 and "data.shuffle_buffer" in out.stderr
    assert not (rd / "job.json").exists()


@pytest.mark.slow
def test_data_clevr_cli_is_deterministic_and_reports_baseline(tmp_path):
    a = vlmrun(
        "data",
        "clevr",
        str(tmp_path / "a"),
        "--train",
        "24",
        "--val",
        "8",
        "--image-size",
        "64",
        "--seed",
        "3",
        "--json",
    )
    b = vlmrun(
        "data",
        "clevr",
        str(tmp_path / "b"),
        "--train",
        "24",
        "--val",
        "8",
        "--image-size",
        "64",
        "--seed",
        "3",
        "--json",
    )
    assert a.returncode == 0 and b.returncode == 0, a.stderr
    summary = json.loads(a.stdout)
    assert 0 < summary["splits"]["val"]["majority_accuracy"] <= 1
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.tar"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "b").glob("*.tar"))
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / ".nv-meta").is_dir()


def test_exit_codes_of_a_failed_check_reach_the_shell(tmp_path):
    for name, loss in (("a", 1.0), ("b", 1.5)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "loss": loss, "grad_norm": 1.0, "sample_ids": ["x"], "step_time_s": 0.1}) + "\n"
        )
        (d / "recipe.yaml").write_text(Path(TINY).read_text())
    out = vlmrun("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--out", str(tmp_path / "o"))
    assert out.returncode == 1
    d = json.loads(out.stdout)
    assert d["verdict"] == "diverged" and d["max_abs_diff"]["loss"] == 0.5
    out = vlmrun("compare", str(tmp_path / "a"), str(tmp_path / "a"), "--json", "--out", str(tmp_path / "o"))
    assert out.returncode == 0 and json.loads(out.stdout)["verdict"] == "match"


def test_slurm_dry_run_prints_recipe_and_inert_sbatch_script(tmp_path):
    hostile = "x$(touch {p})`touch {p}`;touch {p}".format(p=tmp_path / "pwned")
    out = vlmrun(
        "submit",
        TINY,
        "--dry-run",
        "--cluster",
        "slurm",
        "--run-dir",
        str(tmp_path / "r"),
        "--json",
        "--set",
        f"cluster.job_name={hostile}",
        "--set",
        f"cluster.env={{V: '{hostile}'}}",
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert "name: tiny-clevr-cpu" in d["recipe"] and d["sbatch_script"].startswith("#!/bin/bash")
    script = tmp_path / "s.sh"
    script.write_text(d["sbatch_script"])
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert not (tmp_path / "r").exists() and not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- --json errors: one JSON object on stdout

JSON_ERRORS = {  # for each command that has --json: an error, and the field it is about
    "submit": (["submit", TINY, "--dry-run", "--set", "train.lr=abc"], "train.lr"),
    "resume": (["resume", "/nonexistent/run"], "JOBID|RUN_DIR"),
    "status": (["status", "/nonexistent/run"], "JOBID|RUN_DIR"),
    "cancel": (["cancel", "/nonexistent/run"], "JOBID|RUN_DIR"),
    "requeue": (["requeue", "/nonexistent/run"], "JOBID|RUN_DIR"),
    "compare": (["compare", "a", "b"], "A"),
    "export": (["export", "/nonexistent/run", "/nonexistent/out"], "RUN_DIR"),
    "bench-loader": (["bench-loader", TINY, "--workers", "x"], "--workers"),
    "bench-plane": (["bench-plane", "--adapters", "local,nfs"], "--adapters"),
    "data clevr": (["data", "clevr", "/nonexistent/out", "--train", "0"], "--train"),  # a usage error (click's)
    "data prepare": (["data", "prepare", "/nonexistent/src", "/nonexistent/out", "--format", "llava"], "src"),
    "data check": (["data", "check", "/nonexistent/set", "--recipe", TINY], "data"),
    "eval": (["eval", "/nonexistent/target"], "TARGET"),
}


def test_every_command_with_json_is_checked_for_its_errors():
    with_json = {path for path, cmd in leaf_commands().items() if any("--json" in p.opts for p in cmd.params)}
    assert with_json == set(JSON_ERRORS)


@pytest.mark.parametrize("path", sorted(JSON_ERRORS))
def test_a_json_command_reports_bad_input_as_one_json_object(path):
    args, field = JSON_ERRORS[path]
    out = vlmrun(*args, "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    error = json.loads(out.stdout)  # the whole of stdout: one object, nothing else
    assert error["exit_code"] == 2 and error["kind"] == "bad_input" and error["field"] == field
    assert error["error"] in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "raised,code,kind",
    [("CheckFailed('the check said no')", 1, "check_failed"), ("RuntimeError('a bug of ours')", 1, "internal")],
)
def test_a_failed_check_and_our_bug_come_as_json_too(raised, code, kind):
    """`status --json` whose layer below raises: the same exit code, one JSON object; our bug keeps its traceback."""
    script = (
        "import sys; import vlmrun.launch.status as s; from vlmrun.errors import CheckFailed\n"
        f"def broken(target=None): raise {raised}\n"
        "s.status = broken; sys.argv = ['vlmrun', 'status', 'x', '--json']\n"
        "from vlmrun.cli import main; main()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    error = json.loads(out.stdout)
    assert out.returncode == error["exit_code"] == code and error["kind"] == kind
    assert ("Traceback" in out.stderr) == (kind == "internal")
    without = subprocess.run(
        [sys.executable, "-c", script.replace(", '--json'", "")], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert without.returncode == code and without.stdout == ""  # without --json: stderr only, as before


# ---------------------------------------------------------------- --json: stdout is the JSON document's alone

NOISY_LAYER = (
    "import os, subprocess, sys; import vlmrun.launch.status as s; from vlmrun.errors import CheckFailed\n"
    "def noisy(target=None):\n"
    "    print('a library prints this')\n"
    "    os.write(1, b'its C part writes this\\n')\n"
    "    subprocess.run([sys.executable, '-c', 'print(\"a process it starts says this\")'])\n"
    "    {ending}\n"
    "s.status = noisy; sys.argv = ['vlmrun', 'status', 'x', '--json']\n"
    "from vlmrun.cli import main; main()\n"
)


@pytest.mark.parametrize("ending,code", [("return {'state': 'RUNNING'}", 0), ("raise CheckFailed('said no')", 1)])
def test_whatever_else_prints_while_a_json_command_runs_goes_to_stderr(ending, code):
    script = NOISY_LAYER.replace("{ending}", ending)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == code and json.loads(out.stdout), out.stdout  # the whole of stdout: one document
    for line in ("a library prints this", "its C part writes this", "a process it starts says this"):
        assert line in out.stderr and line not in out.stdout


def test_a_dry_run_json_stays_one_document_when_a_reward_module_prints(tmp_path):
    (tmp_path / "noisy_reward.py").write_text(
        'print("noisy_reward: loading the grader")\n\n\ndef score(response, sample, ended):\n    return 1.0\n'
    )
    grpo = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
    rewards = "grpo.rewards=[{fn: noisy_reward:score}]"
    out = vlmrun(
        *("submit", grpo, "--dry-run", "--cluster", "local", "--set", rewards, "--json"),
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["dry_run"] is True and "noisy_reward: loading the grader" in out.stderr
