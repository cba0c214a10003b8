"""Hostile and damaged input, as a user meets it through the CLI: one or two lines naming the field or
the file, exit 2, no traceback, and nothing left behind.

1. Recipe values: floats are finite in every section, booleans are not numbers (nor numbers booleans),
   optimizer betas lie in [0, 1), `logger.metrics_file` may not be a name the run directory uses,
   and a section given whole by `--set` is merged key by key into the recipe's.
2. Bounded parsing: a "billion laughs" recipe (nested YAML aliases) is refused in well under a second.
3. Damaged run files: metrics.jsonl with bad UTF-8, a step that is not a whole number, a missing step
   or a metric that is not a number; recipe.yaml that is not YAML or not a recipe; job.json that is not
   text; `data clevr` onto a file. A torn last line of metrics.jsonl (a killed writer) is normal: compare
   reads the whole rows and names the torn one; a verdict "diverged" always says why.

No training runs: run directories are built by hand from tests/fixtures/format1-run.
"""

from __future__ import annotations

import json
import resource
import subprocess
from pathlib import Path

import pytest
import yaml
from vlmrun_cli import ROOT, TINY, refused, vlmrun

from vlmrun.run.directory import RUN_NAMES

FIXTURE = ROOT / "tests" / "fixtures" / "format1-run"
# Had a refusal regressed, a submit would start this 1-step run instead of a 200-step one.
SMALL = ["--set", "train.max_steps=1", "--set", "train.val_samples=0", "--set", "data.synthetic={train: 8, val: 8}"]
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def children_cpu() -> float:
    """The CPU seconds of this process's ended children (a finished `vlmrun` command's included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def submit(tmp_path: Path, *args: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    """Submit into tmp_path/run; a refused submit must leave no run dir and no data set behind."""
    flags = ["--dry-run"] if dry_run else SMALL
    out = vlmrun("submit", *args, "--cluster", "local", "--run-dir", str(tmp_path / "run"), *flags, cwd=tmp_path)
    if out.returncode == 2:
        assert not any((tmp_path / name).exists() for name in ("run", "runs", "data")), sorted(tmp_path.iterdir())
    return out


def make_run(root: Path, name: str, *, metrics: bytes | None = None, recipe: str | None = None) -> Path:
    """A run dir built by hand: the format-1 fixture's recipe.yaml and metrics.jsonl, either replaced."""
    run = root / name
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe if recipe is not None else (FIXTURE / "recipe.yaml").read_text())
    (run / "metrics.jsonl").write_bytes(metrics if metrics is not None else (FIXTURE / "metrics.jsonl").read_bytes())
    return run


GOOD_ROWS = (FIXTURE / "metrics.jsonl").read_bytes()


# --- 1. recipe values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=.inf", "train.lr"),
        ("train.lr=-.inf", "train.lr"),
        ("train.weight_decay=.nan", "train.weight_decay"),
        ("train.betas=[.nan, 0.9]", "train.betas.0"),
        ("cluster.nodes=.inf", "cluster.nodes"),
        ("data.max_seq_len=.nan", "data.max_seq_len"),
        ("train.max_steps=true", "train.max_steps"),
        ("train.lr=true", "train.lr"),
        ("data.synthetic.seed=false", "data.synthetic.seed"),
        ("model.tiny=1", "model.tiny"),
        ("train.betas=[1.0, 0.9]", "train.betas.0"),
        ("train.betas=[-0.1, 0.9]", "train.betas.0"),
    ],
)
def test_bad_values_are_refused_at_dry_run(tmp_path, override, field):
    refused(submit(tmp_path, TINY, "--set", override), field)


@pytest.mark.parametrize("name", ["recipe.yaml", "job.json", "REQUEUE_REQUESTED", "Checkpoints", ".."])
def test_metrics_file_may_not_be_a_name_the_run_dir_uses(tmp_path, name):
    refused(submit(tmp_path, TINY, "--set", f"logger.metrics_file={name}"), "logger.metrics_file")


def test_run_names_cover_every_file_the_run_writes():
    from vlmrun.run import directory, requests

    assert {
        directory.LOCK_FILE,
        directory.LOCK_HOLDER_FILE,
        requests.REQUEUE_REQUEST,
        requests.CANCEL_REQUEST,
    } <= RUN_NAMES
    assert {"recipe.yaml", "job.json", "checkpoints", "logs", "submitit", "cache", "wandb", "ray"} <= RUN_NAMES


def test_a_refused_submit_leaves_nothing_behind(tmp_path):
    refused(submit(tmp_path, TINY, "--set", "train.lr=.inf", dry_run=False), "train.lr")


def test_a_metrics_file_collision_leaves_nothing_behind(tmp_path):
    refused(submit(tmp_path, TINY, "--set", "logger.metrics_file=recipe.yaml", dry_run=False), "metrics_file")


def test_a_bad_value_in_the_recipe_file_is_named(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(TINY).read_text().replace("lr: 2.0e-3", "lr: .inf"))
    refused(submit(tmp_path, str(recipe)), "train.lr", "finite")


def test_a_section_given_by_set_is_merged_into_the_recipes(tmp_path):
    out = submit(tmp_path, TINY, "--set", "train={max_steps: 5}", "--set", "cluster={nodes: 1}")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["max_steps"] == 5
    # the rest of each section keeps the recipe's values, not the defaults (lr 1e-4, time limit 60)
    assert (resolved["train"]["lr"], resolved["train"]["warmup_steps"], resolved["train"]["micro_batch_size"]) == (
        2.0e-3,
        10,
        2,
    )
    assert (resolved["cluster"]["time_limit"], resolved["cluster"]["signal_delay_s"]) == (30, 60)


# --- 2. bounded parsing -------------------------------------------------------------------------


def test_billion_laughs_recipe_fails_fast(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(LAUGHS + "name: *i\nmodel: {family: qwen2_5_vl, tiny: true}\ndata: {path: d}\n")
    cpu = children_cpu()
    out = submit(tmp_path, str(bomb))
    assert children_cpu() - cpu < 5  # the command's CPU, not the wall clock of a busy machine
    refused(out, "bomb.yaml", "expands to more than")


def test_billion_laughs_in_a_set_value_fails_fast(tmp_path):
    inline = "{" + LAUGHS.replace("\n", ", ").rstrip(", ") + ", z: *i}"
    cpu = children_cpu()
    out = submit(tmp_path, TINY, "--set", f"cluster.env={inline}")
    assert children_cpu() - cpu < 5
    refused(out, "cluster.env", "expands to more than")


# --- 3. damaged run files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage, words",
    [
        (b'{"step": 10, "attempt": 0, "loss": 1.0, "note": "\xff\xfe"}\n', "not UTF-8"),
        (b'{"step": "ten", "attempt": 0, "loss": 1.0}\n', "step is 'ten'"),
        (b'{"step": 10.5, "attempt": 0, "loss": 1.0}\n', "step is 10.5"),
        (b'{"attempt": 0, "loss": 1.0}\n', "no step"),
        (b'{"step": 10, "attempt": 0, "loss": "low"}\n', "loss is 'low'"),
        (b'{"step": 10, "attempt": true}\n', "attempt is True"),
        (b"[1, 2]\n", "a JSON object"),
    ],
    ids=["bad-utf8", "str-step", "float-step", "no-step", "str-loss", "bool-attempt", "not-object"],
)
def test_compare_names_a_damaged_metrics_file(tmp_path, damage, words):
    good = make_run(tmp_path, "good")
    bad = make_run(tmp_path, "bad", metrics=GOOD_ROWS + damage)
    refused(vlmrun("compare", str(good), str(bad), cwd=tmp_path), f"{bad}/metrics.jsonl", "line 10", words)


def test_status_names_a_damaged_last_row(tmp_path):
    bad = make_run(tmp_path, "bad", metrics=GOOD_ROWS + b'{"step": "ten", "attempt": 0}\n')
    refused(vlmrun("status", str(bad), cwd=tmp_path), f"{bad}/metrics.jsonl", "its last row", "step is 'ten'")


def test_damage_in_the_middle_is_named_by_line(tmp_path):
    lines = GOOD_ROWS.splitlines(keepends=True)
    bad = make_run(tmp_path, "bad", metrics=b"".join(lines[:3] + [b"\x00\x00garbage\n"] + lines[3:]))
    good = make_run(tmp_path, "good")
    refused(vlmrun("compare", str(good), str(bad), cwd=tmp_path), "metrics.jsonl", "line 4", "not JSON")


def squeezed_text(text: str) -> str:
    """`text` with every run of white space (a table's line wrap) as one space."""
    return " ".join(text.split())


def test_compare_reads_what_is_whole_and_says_what_it_skipped(tmp_path):
    """A run killed while it wrote its last row, beside one that wrote it: the torn row is named, its step
    is compared on neither side, and the verdict is that of the whole rows; a step only one run has is a
    divergence, and says so."""
    rows = GOOD_ROWS.splitlines(keepends=True)
    whole = make_run(tmp_path, "whole")  # steps 1..9
    torn = make_run(tmp_path, "torn", metrics=b"".join(rows[:8]) + rows[8][:40])  # 1..8, then step 9 cut off
    out = vlmrun("compare", str(whole), str(torn), "--json", "--out", str(tmp_path / "o"), cwd=tmp_path)
    result = json.loads(out.stdout)
    assert out.returncode == 0 and result["verdict"] == "match" and result["reasons"] == [], out.stdout
    assert result["steps_compared"] == 8 and result["skipped"] == [
        f"{torn}/metrics.jsonl: line 9 (step 9) is a row a killed writer left half-written: skipped"
    ]
    text = vlmrun("compare", str(whole), str(torn), "--out", str(tmp_path / "o"), cwd=tmp_path).stdout
    assert "line 9 (step 9)" in squeezed_text(text) and "verdict: match" in text
    shorter = make_run(tmp_path, "shorter", metrics=b"".join(rows[:7]) + rows[7][:40])  # 1..7, step 8 torn
    out = vlmrun("compare", str(whole), str(shorter), "--json", "--out", str(tmp_path / "o"), cwd=tmp_path)
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["verdict"] == "diverged", out.stdout
    assert result["reasons"] == ["1 step(s) only in whole: 9"] and "(step 8)" in result["skipped"][0]
    text = vlmrun("compare", str(whole), str(shorter), "--out", str(tmp_path / "o"), cwd=tmp_path).stdout
    assert "verdict: diverged (rtol 0.0): 1 step(s) only in whole: 9" in squeezed_text(text)


def test_a_diverged_comparison_says_why(tmp_path):
    rows = GOOD_ROWS.splitlines(keepends=True)
    other = json.loads(rows[4])
    other["loss"] += 1e-6
    other["sample_ids"] = other["sample_ids"][::-1]
    changed = make_run(
        tmp_path, "changed", metrics=b"".join([*rows[:4], json.dumps(other).encode() + b"\n", *rows[5:]])
    )
    out = vlmrun("compare", str(make_run(tmp_path, "good")), str(changed), "--json", "--out", str(tmp_path / "o"))
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["verdict"] == "diverged"
    assert result["reasons"] == ["loss not bitwise equal from step 5", "sample ids differ from step 5"]


def test_a_torn_last_line_is_tolerated(tmp_path):
    good = make_run(tmp_path, "good")
    torn = make_run(tmp_path, "torn", metrics=GOOD_ROWS + b'{"step": 10, "attempt": 0, "lo')
    out = vlmrun("compare", str(good), str(torn), "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["verdict"] == "match", out.stderr
    out = vlmrun("status", str(torn), "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["last_step"] == 9, out.stderr


@pytest.mark.parametrize(
    "recipe, words",
    [
        ("name: [unclosed\n", "malformed YAML"),
        ("\x00\x01 binary", "malformed YAML"),
        ("- a list\n", "YAML mapping"),
        (LAUGHS + "name: *i\n", "expands to more than"),
        ((FIXTURE / "recipe.yaml").read_text().replace("lr: 0.002", "lr: .inf"), "train.lr"),
        (
            (FIXTURE / "recipe.yaml").read_text().replace("metrics_file: metrics.jsonl", "metrics_file: job.json"),
            "logger.metrics_file",
        ),
    ],
    ids=["not-yaml", "binary", "not-mapping", "billion-laughs", "inf", "metrics-file"],
)
def test_compare_names_a_damaged_recipe_yaml(tmp_path, recipe, words):
    good = make_run(tmp_path, "good")
    bad = make_run(tmp_path, "bad", recipe=recipe)
    refused(vlmrun("compare", str(good), str(bad), cwd=tmp_path), f"{bad}/recipe.yaml", words)


def test_a_recipe_yaml_that_is_not_utf8_is_named(tmp_path):
    good = make_run(tmp_path, "good")
    bad = make_run(tmp_path, "bad")
    (bad / "recipe.yaml").write_bytes(b"name: \xff\xfe\n")
    refused(vlmrun("compare", str(good), str(bad), cwd=tmp_path), f"{bad}/recipe.yaml", "UTF-8")


def test_resume_names_a_recipe_yaml_that_is_not_yaml(tmp_path):
    bad = make_run(tmp_path, "bad", recipe="name: [unclosed\n")
    refused(vlmrun("resume", str(bad), cwd=tmp_path), f"{bad}/recipe.yaml", "malformed YAML")


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 50000], ids=["bad-utf8", "deep"])
def test_status_names_a_damaged_job_json(tmp_path, content):
    run = make_run(tmp_path, "run")
    (run / "job.json").write_bytes(content)
    refused(vlmrun("status", str(run), cwd=tmp_path), f"{run}/job.json")


def test_data_clevr_onto_a_file(tmp_path):
    target = tmp_path / "taken"
    target.write_text("keep me\n")
    refused(vlmrun("data", "clevr", str(target), "--train", "2", "--val", "2", cwd=tmp_path), str(target))
    refused(vlmrun("data", "clevr", str(target / "sub"), "--train", "2", "--val", "2", cwd=tmp_path), "file")
    assert target.read_text() == "keep me\n" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize(
    "split_yaml, words",
    [
        ("split_parts: [unclosed\n", "malformed YAML"),
        ("- a list\n", "split_parts"),
        ("split_parts: {train: [train-0.tar, gone.tar]}\n", "'gone.tar'"),
        (LAUGHS + "split_parts: {train: *i}\n", "expands to more than"),
    ],
    ids=["not-yaml", "not-mapping", "unknown-shard", "billion-laughs"],
)
def test_submit_names_a_damaged_energon_meta(tmp_path, split_yaml, words):
    meta = tmp_path / "set" / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / ".info.json").write_text('{"shard_counts": {"train-0.tar": 4}}')
    (meta / "split.yaml").write_text(split_yaml)
    sets = ["--set", "data.synthetic=null", "--set", f"data.path={tmp_path / 'set'}", "--set", "train.val_samples=0"]
    refused(submit(tmp_path, TINY, *sets), "split.yaml", words)
