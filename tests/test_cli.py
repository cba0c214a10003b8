"""The CLI as a user meets it: help, dry runs, and bad input that exits 2 naming the field, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")


def vlmrun(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=120)


def test_help_lists_commands_and_imports_nothing_heavy():
    out = vlmrun("--help")
    assert out.returncode == 0
    for cmd in ("submit", "resume", "compare", "data"):
        assert cmd in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, vlmrun.cli; print(sorted(m for m in ('torch','ray','transformers','megatron.energon') if m in sys.modules))"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "[]"


@pytest.mark.parametrize("cmd", ["submit", "resume", "compare", "data"])
def test_each_command_help_has_an_example(cmd):
    out = vlmrun(cmd, "--help")
    assert out.returncode == 0 and "vlmrun" in out.stdout


def test_dry_run_json_names_run_dir_and_starts_nothing(tmp_path):
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", "--run-dir", str(tmp_path / "r"), "--json",
                 "--set", "train.max_steps=5")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run_dir"] == str(tmp_path / "r") and data["dry_run"] is True
    assert "max_steps: 5" in data["recipe"]
    assert not (tmp_path / "r").exists()


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


def test_resume_refuses_fingerprinted_override_before_starting(tmp_path):
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", "--json")
    assert out.returncode == 0
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "recipe.yaml").write_text(json.loads(out.stdout)["recipe"])
    out = vlmrun("resume", str(rd), "--set", "data.shuffle_buffer=8")
    assert out.returncode == 2 and "data.shuffle_buffer" in out.stderr
    assert not (rd / "job.json").exists()


def test_data_clevr_cli_is_deterministic_and_reports_baseline(tmp_path):
    a = vlmrun("data", "clevr", str(tmp_path / "a"), "--train", "24", "--val", "8", "--image-size", "64", "--seed", "3", "--json")
    b = vlmrun("data", "clevr", str(tmp_path / "b"), "--train", "24", "--val", "8", "--image-size", "64", "--seed", "3", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr
    summary = json.loads(a.stdout)
    assert 0 < summary["splits"]["val"]["majority_accuracy"] <= 1
    for tar in sorted((tmp_path / "a").glob("*.tar")):
        assert tar.read_bytes() == (tmp_path / "b" / tar.name).read_bytes()
    assert (tmp_path / "a" / ".nv-meta").is_dir()


def test_exit_codes_of_a_failed_check_reach_the_shell(tmp_path):
    for name, loss in (("a", 1.0), ("b", 1.5)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "grad_norm": 1.0, "sample_ids": ["x"],
                                                     "step_time_s": 0.1}) + "\n")
        (d / "recipe.yaml").write_text(Path(TINY).read_text())
    out = vlmrun("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--out", str(tmp_path / "o"))
    assert out.returncode == 1
    d = json.loads(out.stdout)
    assert d["verdict"] == "diverged" and d["max_abs_diff"]["loss"] == 0.5
    out = vlmrun("compare", str(tmp_path / "a"), str(tmp_path / "a"), "--json", "--out", str(tmp_path / "o"))
    assert out.returncode == 0 and json.loads(out.stdout)["verdict"] == "match"


def test_slurm_dry_run_prints_recipe_and_inert_sbatch_script(tmp_path):
    hostile = "x$(touch {p})`touch {p}`;touch {p}".format(p=tmp_path / "pwned")
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "slurm", "--run-dir", str(tmp_path / "r"), "--json",
                 "--set", f"cluster.job_name={hostile}", "--set", f"cluster.env={{V: '{hostile}'}}")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert "name: tiny-clevr-cpu" in d["recipe"] and d["sbatch_script"].startswith("#!/bin/bash")
    script = tmp_path / "s.sh"
    script.write_text(d["sbatch_script"])
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert not (tmp_path / "r").exists() and not (tmp_path / "pwned").exists()
