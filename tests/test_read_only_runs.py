"""A run directory on a read-only file system (an archive, a read-only mount of a colleague's runs):
`vlmrun eval` scores it and writes nothing into it, `vlmrun resume` says in one line that it is not
writable (exit 2). Through the CLI, on a read-only bind mount of the session's runs (tests/file_systems.py)."""

from __future__ import annotations

import json

import pytest
from file_systems import read_only_view
from vlmrun_cli import refused, vlmrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_eval_of_a_read_only_run_dir_scores_it(sft_baseline, tmp_path, user_cache):
    with read_only_view(sft_baseline, tmp_path / "read-only") as run:
        done = vlmrun("eval", str(run), "--samples", "4", "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["kind"] == "checkpoint" and got["target"] == str(run) and got["val_samples"] == 4
    exports = user_cache / "vlmrun" / "eval"
    assert exports.is_dir() and not any(exports.iterdir())  # its temporary export went, from the user's cache


def test_resume_of_a_read_only_run_dir_says_it_is_not_writable(finished_run, tmp_path):
    with read_only_view(finished_run, tmp_path / "read-only") as run:
        out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait", timeout=120)
        refused(out, "RUN_DIR", str(run), "is not writable", "Read-only file system")
