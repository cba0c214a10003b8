"""job.json through the typed record: round trip, atomic writes, the format-1 migration, damaged files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest

from vlmrun.errors import InputError
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import Attempt, JobRecord, read_job, write_job
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.state import State

FORMAT1 = Path(__file__).resolve().parent / "fixtures" / "format1-run"


@pytest.fixture
def rd(tmp_path) -> RunDirectory:
    return RunDirectory(tmp_path / "run")


def raw(rd: RunDirectory) -> dict:
    return json.loads(rd.job_file.read_text())


def test_a_run_without_job_json_has_no_record(rd):
    assert read_job(rd) is None and job_record.next_attempt(rd) == 0
    with pytest.raises(InputError) as e:
        job_record.require_job(rd)
    assert str(rd.job_file) in str(e.value)


def test_submit_attempt_and_outcome_round_trip(rd):
    job_record.add_job(rd, "41", "slurm", "tiny")
    index = job_record.begin_attempt(rd, "41", 0)
    outcome = RunOutcome(
        State.STOPPED,
        last_step=9,
        reason="stop requested (SIGUSR2)",
        stop_signal="SIGUSR2",
        max_steps=40,
        checkpoint_save_s=[0.5],
        final_val={"val_samples": 4, "val_loss": 0.25},
        worker_nodes=["n1"],
    )
    job_record.end_attempt(rd, index, outcome)
    job = read_job(rd)
    [a] = job.attempts
    assert (job.cluster, job.name, job.state, job.job_ids, job.reason) == (
        "slurm",
        "tiny",
        State.STOPPED,
        ["41"],
        "stop requested (SIGUSR2)",
    )
    assert (a.attempt, a.job_id, a.restart_count, a.state, a.last_step, a.stop_signal) == (
        0,
        "41",
        0,
        State.STOPPED,
        9,
        "SIGUSR2",
    )
    assert a.max_steps == 40 and a.checkpoint_save_s == [0.5] and a.worker_nodes == ["n1"] and a.ended
    assert job.submits[0].job_id == "41" and job_record.next_attempt(rd) == 1
    write_job(rd, job)
    assert read_job(rd) == job
    # The JSON users' scripts read: the same keys and state strings as before the typed record.
    on_disk = raw(rd)
    assert on_disk["state"] == "STOPPED" and on_disk["job_ids"] == ["41"] and on_disk["cluster"] == "slurm"
    assert on_disk["attempts"][0]["restart_count"] == 0 and on_disk["attempts"][0]["state"] == "STOPPED"
    assert on_disk["attempts"][0]["final_val"] == {"val_samples": 4, "val_loss": 0.25}
    assert "requeue_cause" not in on_disk["attempts"][0] and "resumed_from" not in on_disk["attempts"][0]


def test_a_failure_and_an_attempt_that_never_ended(rd):
    first = job_record.begin_attempt(rd, "local-1", 0)
    assert read_job(rd).cluster == "local" and read_job(rd).state is State.RUNNING
    second = job_record.begin_attempt(rd, "local-2", 0)  # the first never recorded its end
    job_record.fail_attempt(rd, second, "ValueError: boom")
    job = read_job(rd)
    assert job.attempts[first].state is State.KILLED and "without recording an outcome" in job.attempts[first].reason
    assert job.attempts[second].state is State.FAILED and job.attempts[second].reason == "ValueError: boom"
    assert job.state is State.FAILED and job.reason == "ValueError: boom" and job.job_ids == ["local-1", "local-2"]


def test_the_running_attempt_is_the_recorded_process_not_its_pid(rd):
    job_record.begin_attempt(rd, "local-1", 0, pid=os.getpid())
    job = read_job(rd)
    assert job_record.running_attempt(job).pid == os.getpid() and job.attempts[0].pid_start is not None
    job.attempts[0].pid_start += 1  # what a later process that got this pid looks like
    assert job_record.running_attempt(job) is None
    job.attempts[0].pid_start = None  # a record written before start times were recorded: the pid alone
    assert job_record.running_attempt(job).pid == os.getpid()
    job.attempts[0].pid = 2**22 + 12345  # no such process
    assert job_record.running_attempt(job) is None
    job.attempts[0].pid = os.getpid()
    job.attempts[0].state = State.COMPLETED
    assert job_record.running_attempt(job) is None


def test_an_attempt_recorded_without_a_start_time_still_reads(rd):
    rd.path.mkdir()
    attempt = {"attempt": 0, "job_id": "local-9", "pid": os.getpid(), "host": os.uname().nodename, "state": "RUNNING"}
    rd.job_file.write_text(json.dumps({"format": 2, "cluster": "local", "job_ids": ["local-9"], "attempts": [attempt]}))
    job = read_job(rd)
    assert job.attempts[0].pid_start is None and job_record.running_attempt(job).job_id == "local-9"
    write_job(rd, job)
    assert "pid_start" not in raw(rd)["attempts"][0]


def test_writes_are_atomic(rd):
    job_record.add_job(rd, "41", "slurm", "tiny")
    before = rd.job_file.read_text()
    job = read_job(rd)
    job.state = State.RUNNING
    with mock.patch("vlmrun.run.directory.os.replace", side_effect=OSError("disk full")), pytest.raises(OSError):
        write_job(rd, job)
    assert rd.job_file.read_text() == before  # readers never see a half-written file
    assert sorted(p.name for p in rd.path.iterdir()) == ["job.json"]  # and no temp file is left behind


def test_the_format1_fixture_loads_with_its_stop_signal():
    job = read_job(RunDirectory(FORMAT1))
    [a] = job.attempts
    assert job.format == job_record.FORMAT and job.state is State.STOPPED and job.job_ids == ["local-18719"]
    assert a.state is State.STOPPED and a.stop_signal == "SIGUSR2" and a.last_step == 9
    assert a.reason == "stop requested (SIGUSR2); checkpointed at step 9"
    assert a.checkpoint_save_s == [0.0345] and a.worker_nodes == ["127.0.0.1", "127.0.0.1"]


def test_the_migration_is_written_once_and_never_repeated(rd):
    rd.path.mkdir()
    shutil.copy(FORMAT1 / "job.json", rd.job_file)
    write_job(rd, read_job(rd))
    on_disk = raw(rd)
    assert on_disk["format"] == job_record.FORMAT and on_disk["attempts"][0]["stop_signal"] == "SIGUSR2"
    # A current-format attempt without the field keeps it empty, whatever its reason text says.
    del on_disk["attempts"][0]["stop_signal"]
    rd.job_file.write_text(json.dumps(on_disk))
    assert read_job(rd).attempts[0].stop_signal is None


def test_the_migration_leaves_other_attempts_alone(rd):
    rd.path.mkdir()
    attempts = [
        {"attempt": 0, "job_id": "7", "state": "FAILED", "reason": "node died (SIGKILL)"},
        {"attempt": 1, "job_id": "7", "state": "STOPPED", "reason": "stop requested (requested)"},
    ]
    rd.job_file.write_text(
        json.dumps({"cluster": "slurm", "name": "n", "state": "STOPPED", "job_ids": ["7"], "attempts": attempts})
    )
    assert [a.stop_signal for a in read_job(rd).attempts] == [None, None]


def test_unknown_keys_are_kept_through_a_read_and_write(rd):
    rd.path.mkdir()
    on_disk = json.loads((FORMAT1 / "job.json").read_text())
    on_disk["written_by"] = "vlmrun 9"
    on_disk["attempts"][0]["gpu_hours"] = 1.5
    rd.job_file.write_text(json.dumps(on_disk))
    job = read_job(rd)
    job.state = State.CANCELLED
    write_job(rd, job)
    again = raw(rd)
    assert again["written_by"] == "vlmrun 9" and again["attempts"][0]["gpu_hours"] == 1.5
    assert again["state"] == "CANCELLED"


@pytest.mark.parametrize(
    "text,problem",
    [
        ("{not json", "not JSON"),
        ('["a", "list"]', "not an object"),
        ('{"format": "two"}', "format"),
        ('{"state": "SLEEPING"}', "state"),
        ('{"attempts": [{"attempt": 0}]}', "attempts.0.job_id"),
    ],
)
def test_a_damaged_job_json_is_an_input_error_naming_the_file(rd, text, problem):
    rd.path.mkdir()
    rd.job_file.write_text(text)
    with pytest.raises(InputError) as e:
        read_job(rd)
    assert str(rd.job_file) in str(e.value) and problem in str(e.value) and e.value.exit_code == 2


def test_the_record_refuses_values_of_the_wrong_type():
    job = JobRecord(cluster="local", name="n")
    with pytest.raises(ValueError):
        job.state = "SLEEPING"
    with pytest.raises(ValueError):
        Attempt(attempt=0, job_id="1", state=State.STOPPED, requeue_cause="boredom")
