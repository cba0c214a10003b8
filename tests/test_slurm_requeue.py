"""Requeue policy: causes told apart, separate budgets, finished runs never requeue, warnings at submit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlmrun.cluster import requeue
from vlmrun.config.load import load_recipe
from vlmrun.config.train import RequeueBudget
from vlmrun.launch.slurm import preflight
from vlmrun.run import requests
from vlmrun.run.directory import RunDirectory
from vlmrun.run.job import Attempt, JobRecord, read_job, write_job
from vlmrun.run.state import State

ROOT = Path(__file__).resolve().parents[1]


def job_with(*attempts: Attempt) -> JobRecord:
    return JobRecord(
        cluster="slurm",
        state=State.RUNNING,
        job_ids=["7"],
        attempts=[a.model_copy(update={"attempt": i}) for i, a in enumerate(attempts)],
    )


def stopped(job_id="7", signal="SIGUSR2", cause=None) -> Attempt:
    return Attempt(
        attempt=0,
        job_id=job_id,
        state=State.STOPPED,
        stop_signal=signal,
        requeue_cause=cause,
        reason=f"stop requested ({signal}); checkpointed at step 5",
    )


@pytest.mark.parametrize(
    "elapsed,expected",
    [(0, "preemption"), (1000, "preemption"), (1619, "preemption"), (1620, "timeout"), (1800, "timeout")],
)
def test_timeout_is_the_last_signal_delay_plus_slack_of_the_limit(elapsed, expected):
    # 30 min limit, USR2 120 s before it, 60 s slack for the 30 s tick: >= 1620 s is a timeout
    assert requeue.classify_stop(elapsed, 30, 120, requested=False) == expected


def test_requested_wins_over_elapsed_time():
    assert requeue.classify_stop(1800, 30, 120, requested=True) == "requested"


def test_budgets_are_separate_per_cause():
    budget = RequeueBudget(timeouts=2, preemptions=1)
    job = job_with(stopped(cause="timeout"), stopped())
    assert requeue.decide(job, job_id="7", cause="timeout", budget=budget).requeue
    assert requeue.decide(job, job_id="7", cause="preemption", budget=budget).requeue
    job = job_with(stopped(cause="timeout"), stopped(cause="preemption"), stopped())
    d = requeue.decide(job, job_id="7", cause="preemption", budget=budget)
    assert not d.requeue and d.state is State.BUDGET_EXHAUSTED and "checkpoint.requeue.preemptions=1" in d.reason
    assert requeue.decide(job, job_id="7", cause="timeout", budget=budget).requeue


def test_budget_counts_only_this_job_id():
    budget = RequeueBudget(timeouts=1, preemptions=0)
    job = job_with(stopped(job_id="6", cause="timeout"), stopped(job_id="7"))
    assert requeue.decide(job, job_id="7", cause="timeout", budget=budget).requeue


def test_zero_budget_ends_at_once_and_requested_needs_no_budget():
    budget = RequeueBudget(timeouts=0, preemptions=0)
    job = job_with(stopped())
    assert requeue.decide(job, job_id="7", cause="timeout", budget=budget).state is State.BUDGET_EXHAUSTED
    assert requeue.decide(job, job_id="7", cause="requested", budget=budget).requeue


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_a_finished_or_failed_run_never_requeues(state):
    job = job_with(Attempt(attempt=0, job_id="7", state=state, reason="done"))
    d = requeue.decide(job, job_id="7", cause="requested", budget=RequeueBudget())
    assert not d.requeue and d.state is state


def test_sigterm_and_cancel_do_not_requeue():
    budget = RequeueBudget()
    d = requeue.decide(job_with(stopped(signal="SIGTERM")), job_id="7", cause="preemption", budget=budget)
    assert not d.requeue and d.state is State.STOPPED and "SIGTERM" in d.reason
    d = requeue.decide(job_with(stopped()), job_id="7", cause="requested", budget=budget, cancelled=True)
    assert not d.requeue and d.state is State.CANCELLED


def test_the_decision_reads_the_stop_signal_field_not_the_reason():
    """A USR2 in the reason text alone does not requeue: the node records the signal as a field."""
    budget = RequeueBudget()
    unsignalled = stopped().model_copy(update={"stop_signal": None})
    d = requeue.decide(job_with(unsignalled), job_id="7", cause="preemption", budget=budget)
    assert not d.requeue and d.state is State.STOPPED and "stopped by a request" in d.reason


def test_a_stop_recorded_by_the_previous_format_still_requeues(tmp_path):
    """Format-1 job.json had no `stop_signal`; loading it fills the field in from the reason."""
    rd = RunDirectory(tmp_path)
    shutil.copy(ROOT / "tests" / "fixtures" / "format1-run" / "job.json", rd.job_file)
    job = read_job(rd)
    d = requeue.decide(job, job_id="local-18719", cause="preemption", budget=RequeueBudget(preemptions=1))
    assert d.requeue and d.state is State.REQUEUED and d.cause == "preemption"


def test_record_writes_state_and_cause(tmp_path):
    rd = RunDirectory(tmp_path)
    write_job(rd, job_with(stopped()))
    requeue.record(rd, requeue.RequeueDecision(True, State.REQUEUED, "timeout", "timeout 1/3: requeued"))
    job = read_job(rd)
    assert job.state is State.REQUEUED and job.attempts[-1].requeue_cause == "timeout"
    assert requeue.used_budget(job.attempts, "7")["timeout"] == 1
    raw = json.loads(rd.job_file.read_text())
    assert raw["state"] == "REQUEUED" and raw["attempts"][-1]["requeue_cause"] == "timeout"
    requeue.record(rd, requeue.RequeueDecision(False, State.STOPPED, "timeout", "requeue failed"))
    assert read_job(rd).attempts[-1].requeue_cause is None
    raw = json.loads(rd.job_file.read_text())
    assert "requeue_cause" not in raw["attempts"][-1] and raw["attempts"][-1]["requeue_decision"] == "requeue failed"


def test_requests_are_taken_once_and_only_for_their_attempt(tmp_path):
    rd = RunDirectory(tmp_path)
    requests.write_request(rd, requests.REQUEUE_REQUEST, "7")
    assert not requests.take_request(rd, requests.REQUEUE_REQUEST, "8", 0)  # stale request of another job: dropped
    requests.write_request(rd, requests.REQUEUE_REQUEST, "7")
    assert requests.take_request(rd, requests.REQUEUE_REQUEST, "7", 0)
    assert not requests.take_request(rd, requests.REQUEUE_REQUEST, "7", 0)
    requests.write_request(rd, requests.REQUEUE_REQUEST, "7", restart=0)  # too late for attempt 0 ...
    assert not requests.take_request(rd, requests.REQUEUE_REQUEST, "7", 1)  # ... so it does not steer attempt 1


@pytest.mark.parametrize(
    "path,params",
    [("/models/Qwen2.5-VL-3B-Instruct", 3e9), ("/m/Nemotron-3-Nano-Omni-30B-A3B", 30e9), ("/m/my-model", None)],
)
def test_parameter_count_from_the_model_name(path, params):
    r = load_recipe(ROOT / "recipes" / "qwen2.5-vl-3b-clevr-1n2g.yaml", [f"model.path={path}"])
    assert preflight.estimate_params(r.model) == params


def test_signal_delay_warnings():
    tiny = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
    assert preflight.signal_delay_warnings(tiny) == []
    omni = load_recipe(ROOT / "recipes" / "omni-clevr-1n8g.yaml", ["cluster.signal_delay_s=120"])
    [w] = preflight.signal_delay_warnings(omni)
    assert "cluster.signal_delay_s=120" in w and "30B parameters" in w and "raise it to at least 540" in w
    short = load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", ["cluster.time_limit=1", "cluster.signal_delay_s=60"])
    assert any("not shorter than cluster.time_limit" in w for w in preflight.signal_delay_warnings(short))
