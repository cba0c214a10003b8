"""Resume and late-found problems, as a user meets them through the CLI, with real runs (local cluster).

A resume compares what defines the run against its checkpoint whatever changed it (`--set` or an
edited recipe.yaml) and refuses with `field: old -> new`, exit 2, writing nothing; the job checks again
against the checkpoint it verified. A completed run with nothing left says so and exits 0 without
starting anything. A data set too small for the layout is refused at submit, not inside the job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def vlmrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A tiny run that completed 4 steps, with checkpoints at steps 2 and 4."""
    base = tmp_path_factory.mktemp("resume")
    run = base / "run"
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--run-dir",
        str(run),
        "--wait",
        "--set",
        f"data.path={base / 'clevr'}",
        "--set",
        "data.synthetic={train: 64, val: 8, image_size: 64, seed: 0}",
        "--set",
        "train.max_steps=4",
        "--set",
        "checkpoint.save_period=2",
        "--set",
        "train.val_samples=0",
        "--set",
        "logger.wandb_mode=disabled",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("cache"))
    return dst


def edit_recipe(run: Path, section: str, key: str, value) -> None:
    raw = yaml.safe_load((run / "recipe.yaml").read_text())
    raw[section][key] = value
    (run / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def one_line_refusal(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert 1 <= len(out.stderr.strip().splitlines()) <= 2, out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_resuming_a_completed_run_says_so_and_starts_nothing(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = (run / "job.json").read_text()
    t0 = time.monotonic()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr
    assert "nothing to do" in out.stdout + out.stderr
    assert time.monotonic() - t0 < 20  # no Ray was started
    assert (run / "job.json").read_text() == before  # no empty attempt recorded


@pytest.mark.parametrize(
    "section, key, value, field",
    [
        ("train", "global_batch_size", 16, "train.global_batch_size: 8 -> 16"),
        ("train", "seed", 7, "train.seed: 1234 -> 7"),
        ("train", "loop", "v1", "train.loop: 'v2' -> 'v1'"),
        ("data", "max_seq_len", 128, "data.max_seq_len: 256 -> 128"),
        ("data", "split", "val", "data.split: 'train' -> 'val'"),
        ("parallel", "dp", 1, "parallel.dp: 2 -> 1"),
        ("model", "dtype", "bfloat16", "model.dtype: 'float32' -> 'bfloat16'"),
    ],
)
def test_an_edited_recipe_yaml_that_changes_the_run_is_refused_naming_old_and_new(
    finished, tmp_path, section, key, value, field
):
    run = copy_of(finished, tmp_path)
    edit_recipe(run, section, key, value)
    before = (run / "job.json").read_text()
    out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait", timeout=60)
    one_line_refusal(out, field)
    assert (run / "job.json").read_text() == before


@pytest.mark.parametrize("override", ["train.loop=v1", "train.global_batch_size=16", "parallel.dp=1", "train.seed=1"])
def test_a_set_that_changes_the_run_is_refused(finished, tmp_path, override):
    run = copy_of(finished, tmp_path)
    out = vlmrun("resume", str(run), "--set", override, "--set", "train.max_steps=6", timeout=60)
    one_line_refusal(out, override.split("=")[0])


def test_the_job_checks_the_checkpoint_it_verified_too(finished, tmp_path):
    """An edit that reaches the job (here: the node started directly) fails it before any step, exit 2."""
    run = copy_of(finished, tmp_path)
    edit_recipe(run, "train", "micro_batch_size", 4)
    edit_recipe(run, "train", "max_steps", 6)
    node = subprocess.run(
        [sys.executable, "-m", "vlmrun.cluster.node", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert node.returncode == 2, node.stderr[-2000:]
    job = json.loads((run / "job.json").read_text())
    assert job["attempts"][-1]["state"] == "FAILED"
    assert "train.micro_batch_size: 2 -> 4" in job["attempts"][-1]["reason"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 4


def test_a_data_set_too_small_for_the_layout_is_refused_at_submit(tmp_path):
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"data.path={tmp_path / 'one'}",
        "--set",
        "data.synthetic={train: 1, val: 8, image_size: 64, seed: 0}",
        timeout=60,
    )
    one_line_refusal(out, "data.path", "parallel.dp")
    assert not (tmp_path / "run").exists() and not (tmp_path / "one").exists()
    dry = vlmrun(
        "submit",
        TINY,
        "--dry-run",
        "--set",
        f"data.path={tmp_path / 'one'}",
        "--set",
        "data.synthetic={train: 1, val: 8, image_size: 64, seed: 0}",
        timeout=60,
    )
    one_line_refusal(dry, "data.path")


def test_an_unwritable_checkpoint_dir_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for extra in ([], ["--dry-run"]):
        out = vlmrun(
            "submit",
            TINY,
            "--cluster",
            "local",
            "--run-dir",
            str(tmp_path / "run"),
            *extra,
            "--set",
            f"checkpoint.dir={blocker / 'ckpt'}",
            timeout=60,
        )
        one_line_refusal(out, "checkpoint.dir")
    assert not (tmp_path / "run").exists()


def test_a_dead_rank_fails_the_run_with_one_plain_line(finished, tmp_path):
    """A rank actor SIGKILLed mid-run: FAILED, one line naming the cause and where, the log's path."""
    import signal

    import psutil

    run = copy_of(finished, tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vlmrun.cli",
            "resume",
            str(run),
            "--wait",
            "--set",
            "train.max_steps=400",
            "--set",
            "train.epochs=100",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        victim = None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            rows = (run / "metrics.jsonl").read_text().splitlines()
            if len(rows) < 6:  # steps 5.. come from this attempt: the ranks are running
                continue
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "SftWorker" in " ".join(p.cmdline()):
                        victim = p
                        break
                except psutil.Error:
                    continue
            if victim is None:  # Ray's workers may hang under the raylet, not under us: search by name
                for p in psutil.process_iter(["cmdline", "environ"]):
                    try:
                        if "SftWorker" in " ".join(p.info["cmdline"] or []) and str(run) in str(p.environ()):
                            victim = p
                            break
                    except psutil.Error:
                        continue
        assert victim is not None, "no rank actor found"
        victim.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if "FAILED:" in line]
    assert len(failed) == 1 and "\x1b" not in failed[0] and "traceback in" in failed[0], err[-3000:]
    job = json.loads((run / "job.json").read_text())
    reason = job["attempts"][-1]["reason"]
    assert job["attempts"][-1]["state"] == "FAILED" and "\n" not in reason and "\x1b" not in reason
    assert "Actor" in reason or "actor" in reason, reason


def test_when_every_checkpoint_is_invalid_the_console_and_job_json_say_so(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    for step_dir in (run / "checkpoints").glob("step_*"):
        model = step_dir / "policy" / "model.pt"
        model.write_bytes(b"x" + model.read_bytes()[1:])
    out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    plain = [line for line in out.stderr.splitlines() if "no valid checkpoint left" in line]
    assert plain and not plain[0].startswith("("), out.stderr[-3000:]  # the node's own line, not Ray's
    job = json.loads((run / "job.json").read_text())
    assert "no valid checkpoint left" in job["attempts"][-1]["notice"]
    assert "training from step 0" in job["attempts"][-1]["notice"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if r["attempt"] == 1) == [1, 2, 3, 4, 5, 6]
