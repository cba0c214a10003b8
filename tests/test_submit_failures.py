"""A submit that cannot reach SLURM, as a user on a login node meets it: one clear error, exit 2, no run dir.

SLURM's clients are stood in for by scripts on PATH that fail as they do when slurmctld is gone
(sbatch, squeue and sinfo print "Unable to contact slurm controller", `scontrol ping` says DOWN), and,
where Debian's SLURM is installed, by the real clients pointed (SLURM_CONF) at a controller port that
nothing listens on. A run dir left by a submit that failed before it recorded a job (recipe.yaml, no
job.json) is known to status, resume and submit as never submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from vlmrun_cli import TINY, refused, vlmrun

DEAD = "Unable to contact slurm controller (connect failure)"


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRUN_JOBS_DIR", str(tmp_path / "registry"))


def tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def dead_slurm(tmp_path) -> dict[str, str]:
    """The environment of a login node whose SLURM controller is gone (fake clients first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "sinfo", "srun"):
        tool(bin_dir, name, f'echo "{name}: error: {DEAD}" >&2; exit 1')
    tool(
        bin_dir,
        "scontrol",
        'if [ "$1" = ping ]; then echo "Slurmctld(primary) at ctl is DOWN"; exit 1; fi\n'
        f'echo "slurm_load_jobs error: {DEAD}" >&2; exit 1',
    )
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def fake_bin(env: dict[str, str]) -> Path:
    """The folder of the stand-in SLURM clients (first on the PATH of `dead_slurm`)."""
    return Path(env["PATH"].split(os.pathsep)[0])


def test_a_controller_that_dies_before_sinfo_is_the_same_error(tmp_path, dead_slurm):
    tool(fake_bin(dead_slurm), "scontrol", 'echo "Slurmctld(primary) at ctl is UP"; exit 0')
    run = tmp_path / "run"
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), env=dead_slurm)
    refused(out, "--cluster slurm", DEAD, "--cluster local")
    assert not run.exists()


@pytest.mark.parametrize("cluster", ["auto", "slurm"])
def test_a_dead_controller_is_one_clear_error_and_leaves_no_run_dir(tmp_path, dead_slurm, cluster):
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = vlmrun("submit", TINY, "--cluster", cluster, "--run-dir", str(run), env=dead_slurm)
    refused(out, f"--cluster {cluster}", "controller does not answer", "is DOWN", "--cluster local")
    assert time.monotonic() - t0 < 30 and not run.exists()  # and no job started on this machine
    as_json = vlmrun("submit", TINY, "--cluster", cluster, "--run-dir", str(run), "--json", env=dead_slurm)
    error = json.loads(as_json.stdout)  # the whole of stdout is one JSON object
    assert as_json.returncode == error["exit_code"] == 2 and error["kind"] == "bad_input"
    assert error["field"] == "--cluster" and error["value"] == cluster and "controller" in error["error"]
    assert not run.exists()


def test_a_dry_run_with_auto_shows_the_slurm_job_and_says_the_controller_does_not_answer(tmp_path, dead_slurm):
    """A dry run submits nothing, so it needs no controller: it shows what a submit would send to SLURM."""
    out = vlmrun("submit", TINY, "--dry-run", "--run-dir", str(tmp_path / "run"), env=dead_slurm)
    assert out.returncode == 0, out.stderr
    assert "# warning: --cluster auto: the SLURM controller does not answer" in out.stdout
    assert "a submit now would be refused" in out.stdout and "#SBATCH" in out.stdout
    assert not (tmp_path / "run").exists()


def test_sbatch_that_cannot_reach_the_controller_after_a_ping_leaves_nothing(tmp_path, dead_slurm):
    """The controller answered the ping and sinfo, and went away before sbatch: the run dir submit made goes again."""
    tool(fake_bin(dead_slurm), "scontrol", 'echo "Slurmctld(primary) at ctl is UP"; exit 0')
    tool(fake_bin(dead_slurm), "sinfo", 'echo "n1|debug*|4|8000|(null)|infinite"')
    run = tmp_path / "run"
    out = vlmrun("submit", TINY, "--cluster", "auto", "--run-dir", str(run), env=dead_slurm)
    refused(out, "sbatch failed", DEAD, "--cluster local")
    assert not run.exists()


def test_a_refused_job_leaves_a_given_run_dir_as_it_was(tmp_path, dead_slurm):
    bin_dir = fake_bin(dead_slurm)
    tool(bin_dir, "scontrol", 'echo "Slurmctld(primary) at ctl is UP"; exit 0')
    tool(bin_dir, "sinfo", 'echo "n1|debug*|4|8000|(null)|infinite"')
    refusal = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
    tool(bin_dir, "sbatch", f'echo "{refusal}" >&2; exit 1')
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file")
    out = vlmrun("submit", TINY, "--cluster", "slurm", "--run-dir", str(run), env=dead_slurm)
    refused(out, "sbatch refused the job", "Invalid account", "cluster section")
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # what submit made is gone, the rest stays


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not (shutil.which("sbatch") and Path("/etc/slurm/slurm.conf").is_file()), reason="needs Debian's SLURM clients"
)
def test_the_real_clients_against_a_port_nothing_listens_on(tmp_path):
    conf = [
        line
        for line in Path("/etc/slurm/slurm.conf").read_text().splitlines()
        if not line.startswith(("SlurmctldHost", "SlurmctldPort"))
    ]
    dead_conf = tmp_path / "slurm.conf"
    dead_conf.write_text("\n".join(["SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={free_port()}", *conf]))
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = vlmrun("submit", TINY, "--run-dir", str(run), env={"SLURM_CONF": str(dead_conf)})
    refused(out, "--cluster auto", "controller does not answer", "--cluster local")
    assert time.monotonic() - t0 < 30 and not run.exists()


# ---------------------------------------------------------------- a run dir that was never submitted


@pytest.fixture
def unsubmitted(tmp_path) -> Path:
    """What a submit killed between writing recipe.yaml and recording its job leaves."""
    out = vlmrun("submit", TINY, "--dry-run", "--cluster", "local", "--json")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "recipe.yaml").write_text(json.loads(out.stdout)["recipe"])
    return run


def test_status_says_never_submitted(unsubmitted):
    out = vlmrun("status", str(unsubmitted), "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["state"] is None and st["job_ids"] == [] and "never submitted" in st["reason"]
    assert f"vlmrun resume {unsubmitted}" in st["reason"]
    text = vlmrun("status", str(unsubmitted))
    assert "neversubmitted" in "".join(text.stdout.split())  # the table's reason line (it may wrap)


def test_resume_runs_it_where_auto_would_so_a_dead_controller_is_refused(unsubmitted, dead_slurm):
    out = vlmrun("resume", str(unsubmitted), env=dead_slurm)
    refused(out, "never submitted", "controller does not answer", "--cluster local")
    assert not (unsubmitted / "job.json").exists() and not (unsubmitted / "lock.json").exists()


def test_submit_into_it_names_what_it_is(unsubmitted):
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(unsubmitted))
    refused(out, "never submitted", f"vlmrun resume {unsubmitted}")


# ---------------------------------------------------------------- a failure after the job began


def _failing_submit(rd, *, recorded: bool) -> None:
    """What a submit's block does before it fails: makes the run dir, records the job (or not), and the
    job writes into it; then the launcher fails (a full disk, say)."""
    import errno

    from vlmrun.config.load import load_recipe
    from vlmrun.launch.submit import _undone_unless_recorded
    from vlmrun.run import job as job_record

    with pytest.raises(OSError), _undone_unless_recorded(rd):
        rd.create(load_recipe(TINY, []))
        if recorded:
            job_record.add_job(rd, "local-1", "local", "tiny")
            job_record.begin_attempt(rd, "local-1", 0)
            (rd.path / "checkpoints" / "step_2").mkdir(parents=True)
            (rd.path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_launcher_failure_after_the_job_was_recorded_deletes_nothing_of_the_run(tmp_path):
    from vlmrun.run.directory import RunDirectory

    rd = RunDirectory(tmp_path / "run")
    _failing_submit(rd, recorded=True)
    assert sorted(p.name for p in rd.path.iterdir()) == [
        "checkpoints",
        "job.json",
        "logs",
        "metrics.jsonl",
        "recipe.yaml",
        "run.json",
    ]
    assert json.loads(rd.job_file.read_text())["job_ids"] == ["local-1"]


def test_a_failure_before_the_job_was_recorded_still_leaves_no_run_dir(tmp_path):
    from vlmrun.run.directory import RunDirectory

    rd = RunDirectory(tmp_path / "run")
    _failing_submit(rd, recorded=False)
    assert not rd.path.exists()
