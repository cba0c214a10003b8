"""job.json: the lineage of a run (every job id, every attempt, the final state and why).

1. This module is the one place that reads and writes job.json: `read_job` / `write_job`, and the
   transitions `add_job` (submit), `set_resume_changes` (resume), `begin_attempt` / `end_attempt` /
   `fail_attempt` (the node), `mark_killed` (whoever finds a job dead that never recorded its end: the
   reaper, cancel, the launcher).
   Others read the typed `JobRecord`, change fields and write it back with `write_job`.
2. Written atomically (temp file + rename). The JSON keeps the key names and state strings users'
   scripts read (`job_ids`, `state`, `attempts[].restart_count`, ...); fields that are None are left
   out; keys this version does not know are kept through a read and write (forward compatibility).
3. Format 1 (files without `format`) did not record `stop_signal`: `read_job` fills it in once from
   the "(SIGxxx)" in a STOPPED attempt's reason, so the requeue decision reads only the field.
4. A job.json that is not JSON, or not a job record, is refused with an InputError naming the file.

The keys (the contract users' scripts read; unset fields are left out):

    format        2
    cluster       "local" or "slurm"
    name          the run's name
    state         the run's state (run/state.py): the last attempt's, or the requeue decision's
    reason        why, in one line: the submit's while PENDING, the running attempt's while RUNNING
                  (never the previous attempt's), then how the last attempt ended
    created       when the record was made (ISO 8601 with UTC offset)
    job_ids       every job id of the lineage, oldest first (a SLURM requeue keeps its id; resume adds one)
    submits       one {job_id, time} per submit or resume
    forks         a copied run directory gone on as a run of its own: {attempt, time, run_id (the new),
                  from_run_id, from_run_dir} per fork (vlmrun/checkpoint/copies.py)
    resume_changes what the last `vlmrun resume` changed (`field: old -> new`), until the attempt it
                  started takes it (its `resumed_with`)
    attempts      one entry per start of the node entrypoint, oldest first:
      attempt          its index; the `attempt` of the metrics rows it wrote
      job_id           the job it ran in
      restart_count    SLURM_RESTART_COUNT (0 on the local executor)
      pid, host        the node-0 process and where it ran
      pid_start        that process's start time (clock ticks since boot): a reused pid is not it
      started, ended   times, ISO 8601
      state, reason    RUNNING while it runs, then how it ended, and why in one line
      last_step        the last optimizer step it completed
      stop_signal      SIGUSR2 or SIGTERM when a signal stopped it
      requeue_cause    "timeout", "preemption" or "requested", when node 0 requeued the job after it
      requeue_decision node 0's reasoning (cluster/requeue.py), also when it did not requeue
      resumed_with     what the `vlmrun resume` that started it changed, `field: old -> new` each
      and what the attempt reported of itself: resumed_from, restarted_data_order, first_step_s,
      max_steps, checkpoint_save_s (what each save held the loop up), checkpoint_write_s (each
      checkpoint's start to its seal), skipped_checkpoints, notice, final_val, worker_nodes,
      ray_alive_nodes, policy_layout, policy_load
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from vlmrun.errors import InputError, short_repr
from vlmrun.run.directory import RunDirectory, write_atomic
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.process import process_alive, start_time
from vlmrun.run.state import State

FORMAT = 2  # 1: no `format` key and no `stop_signal`; 2: `stop_signal` recorded by the node

RequeueCause = Literal["timeout", "preemption", "requested"]
# the reason of an attempt found dead by someone who cannot know why (its reaper, the next attempt)
KILLED_REASON = "ended without recording an outcome (killed: SIGKILL, out of memory or node loss)"


def now() -> str:
    """Local time as job.json spells it (ISO 8601 with the UTC offset, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True, coerce_numbers_to_str=True)

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler) -> dict[str, Any]:
        fields = type(self).model_fields
        return {k: v for k, v in handler(self).items() if not (k in fields and v is None)}


class Attempt(_Record):
    """One start of the node entrypoint: `attempt` is its index (the `attempt` of metrics rows).

    `stop_signal` is the signal that stopped it (SIGUSR2, SIGTERM), None for a finished run or a
    stop by request; `requeue_cause` is set only when node 0 requeued the job after this attempt.
    """

    attempt: int
    job_id: str
    restart_count: int = 0
    pid: int | None = None
    pid_start: int | None = None  # the pid's process start time (run/process.py): a reused pid differs
    host: str | None = None
    started: str | None = None
    ended: str | None = None
    state: State = State.RUNNING
    reason: str | None = None
    last_step: int | None = None
    stop_signal: str | None = None
    requeue_cause: RequeueCause | None = None
    requeue_decision: str | None = None
    # What the node records about how the attempt went (RunOutcome.details()).
    resumed_from: int | None = None
    restarted_data_order: str | None = None
    first_step_s: float | None = None
    max_steps: int | None = None
    checkpoint_save_s: list[float] | None = None
    checkpoint_write_s: list[float] | None = None
    skipped_checkpoints: list[str] | None = None
    final_val: dict[str, float | int] | None = None
    worker_nodes: list[str] | None = None
    ray_alive_nodes: int | None = None
    policy_layout: str | None = None
    policy_load: str | None = None
    notice: str | None = None  # what the user must know about how it started (no valid checkpoint left, ...)
    resumed_with: list[str] | None = None  # what the `vlmrun resume` that started it changed: `field: old -> new`


class Fork(_Record):
    """A copied run directory that went on as a run of its own at attempt `attempt` (checkpoint/copies.py):
    its new run id, and the run (id, directory) it was copied from."""

    attempt: int
    time: str
    run_id: str
    from_run_id: str
    from_run_dir: str


class Submit(_Record):
    """One `vlmrun submit` / `resume` of the run: the job id it got and when."""

    job_id: str
    time: str


class JobRecord(_Record):
    """The whole of job.json; `format` says which version of this layout wrote it.

    `state` and `reason` are the run's (the last attempt's, or the requeue decision's); `job_ids`
    lists every job id of the lineage, oldest first.
    """

    format: int = FORMAT
    cluster: Literal["local", "slurm"] = "local"
    name: str = ""
    state: State = State.PENDING
    created: str = Field(default_factory=now)
    job_ids: list[str] = Field(default_factory=list)
    attempts: list[Attempt] = Field(default_factory=list)
    submits: list[Submit] = Field(default_factory=list)
    reason: str | None = None
    forks: list[Fork] | None = None  # this run directory copied from another, gone on as a fork
    resume_changes: list[str] | None = None  # set by `vlmrun resume`, taken by the attempt it starts


def read_job(rd: RunDirectory) -> JobRecord | None:
    """The job record of `rd`; None when the run has none yet (never submitted).

    Raises InputError naming the file when job.json is not JSON or not a job record.
    """
    path = rd.job_file
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise _damaged(path, "not UTF-8 text") from None
    except OSError as e:  # a folder, or unreadable
        raise _damaged(path, f"cannot read it: {e.strerror or e}") from None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise _damaged(path, f"not JSON: {short_repr(str(e), quote=False)}") from None
    if not isinstance(raw, dict):
        raise _damaged(path, f"a JSON {type(raw).__name__}, not an object")
    version = raw.get("format", 1)
    if not isinstance(version, int):
        raise _damaged(path, f"format: {short_repr(version)} is not a format number")
    try:
        return JobRecord.model_validate(_from_format1(raw) if version < FORMAT else raw)
    except ValidationError as e:
        raise _damaged(path, _first_error(e)) from None


def require_job(rd: RunDirectory) -> JobRecord:
    """The job record of `rd`, which must exist (the job was submitted or an attempt begun).

    Raises InputError naming the file when it is missing or damaged.
    """
    job = read_job(rd)
    if job is None:
        raise InputError("RUN_DIR", str(rd.path), message=f"{rd.job_file} does not exist: this run was never started")
    return job


def write_job(rd: RunDirectory, job: JobRecord) -> None:
    """Write `job` to `rd`'s job.json atomically (readers see the old or the new file, never a torn one)."""
    write_atomic(rd.job_file, json.dumps(job.model_dump(), indent=2, sort_keys=True) + "\n")


def next_attempt(rd: RunDirectory) -> int:
    """The index the next attempt of `rd` will get (its log is `rd.attempt_log(index)`)."""
    job = read_job(rd)
    return len(job.attempts) if job else 0


def add_job(rd: RunDirectory, job_id: str, cluster: Literal["local", "slurm"], name: str) -> JobRecord:
    """Record a submitted job: its id joins the lineage, the run is PENDING (creates job.json if needed).

    The run's reason becomes the submit's own: what the previous attempt said is that attempt's."""
    job = read_job(rd) or JobRecord(cluster=cluster, name=name)
    if job_id not in job.job_ids:
        job.job_ids.append(job_id)
    submitted = Submit(job_id=job_id, time=now())
    job.state, job.reason = (
        State.PENDING,
        f"job {job_id} submitted {submitted.time}; attempt {len(job.attempts)} not begun",
    )
    job.submits.append(submitted)
    write_job(rd, job)
    return job


def begin_attempt(rd: RunDirectory, job_id: str, restart_count: int, pid: int | None = None) -> int:
    """Record the start of an attempt on this host; returns its index (the `attempt` of metrics rows).

    An earlier attempt still RUNNING never recorded its end (SIGKILL, node loss): it becomes KILLED.
    The run's reason becomes this attempt's (RUNNING since when, where), not the previous one's.
    """
    job = read_job(rd) or JobRecord(cluster="local", name=rd.path.name)
    for a in job.attempts:
        if a.state is State.RUNNING:
            a.state, a.ended, a.reason = State.KILLED, a.ended or now(), KILLED_REASON
    index = len(job.attempts)
    pid = pid or os.getpid()
    attempt = Attempt(
        attempt=index,
        job_id=job_id,
        restart_count=restart_count,
        pid=pid,
        pid_start=start_time(pid),
        host=os.uname().nodename,
        started=now(),
        state=State.RUNNING,
        resumed_with=job.resume_changes,
    )
    job.resume_changes = None
    job.attempts.append(attempt)
    if job_id not in job.job_ids:
        job.job_ids.append(job_id)
    job.state = State.RUNNING
    job.reason = (
        f"attempt {index} running since {attempt.started} on {attempt.host} (job {job_id}, restart {restart_count})"
    )
    write_job(rd, job)
    return index


def end_attempt(rd: RunDirectory, index: int, outcome: RunOutcome) -> None:
    """Record how attempt `index` ended (state, reason, last step, stop signal and the outcome's details)."""
    job = require_job(rd)
    a = job.attempts[index]
    fields = outcome.details() | {
        "state": outcome.state,
        "reason": outcome.reason,
        "last_step": outcome.last_step,
        "stop_signal": outcome.stop_signal,
        "ended": now(),
    }
    for key, value in fields.items():
        setattr(a, key, value)
    job.state, job.reason = outcome.state, outcome.reason
    write_job(rd, job)


def fail_attempt(rd: RunDirectory, index: int, reason: str) -> None:
    """Record that attempt `index` failed (an exception in the node entrypoint) and why."""
    job = require_job(rd)
    a = job.attempts[index]
    a.state, a.reason, a.ended = State.FAILED, reason, now()
    job.state, job.reason = State.FAILED, reason
    write_job(rd, job)


def mark_killed(rd: RunDirectory, job_id: str, pid: int | None = None, *, reason: str = KILLED_REASON) -> bool:
    """Record that job `job_id` ended without recording an outcome (SIGKILL, OOM, node loss).

    Its attempts still RUNNING (only the one of `pid`, when given) become KILLED, and so does the run
    when that job is its last and it has not recorded an end. A `reason` that knows more (`vlmrun
    cancel` killed it) also replaces the generic one of an attempt someone already found dead (its
    reaper). Returns whether anything changed. The caller holds the run lock (run/lock.py), so no
    new attempt begins meanwhile.
    """
    job = read_job(rd)
    if job is None:
        return False
    changed = False
    for a in job.attempts:
        if a.job_id == str(job_id) and _unrecorded(a, reason) and (pid is None or a.pid == pid):
            a.state, a.ended, a.reason = State.KILLED, a.ended or now(), reason
            changed = True
    last = bool(job.job_ids) and job.job_ids[-1] == str(job_id)
    if last and (job.state in (State.PENDING, State.RUNNING) or (changed and job.state is State.KILLED)):
        job.state, job.reason = State.KILLED, reason if changed else "ended before it began an attempt (killed)"
        changed = True
    if changed:
        write_job(rd, job)
    return changed


def began_unrecorded(job: JobRecord, job_id: str) -> bool:
    """True when an attempt of `job_id` began and never recorded how it ended (RUNNING, or KILLED by
    whoever found it dead)."""
    return any(a.job_id == str(job_id) and _unrecorded(a, None) for a in job.attempts)


def _unrecorded(a: Attempt, reason: str | None) -> bool:
    """RUNNING, or KILLED with the generic reason (`reason`, when it says more, may replace it)."""
    return a.state is State.RUNNING or (a.state is State.KILLED and a.reason == KILLED_REASON and reason != a.reason)


def set_resume_changes(rd: RunDirectory, changes: list[str], *, cluster: Literal["local", "slurm"], name: str) -> None:
    """Record what a `vlmrun resume` changes (`field: old -> new`, may be empty) for the attempt it
    starts: the next `begin_attempt` takes it into that attempt's `resumed_with`."""
    job = read_job(rd)
    if job is None and not changes:
        return
    job = job or JobRecord(cluster=cluster, name=name)
    if job.resume_changes != (changes or None):
        job.resume_changes = changes or None
        write_job(rd, job)


def note_attempt(rd: RunDirectory, index: int, notice: str) -> None:
    """Record `notice` on attempt `index` (one plain line the user must know, e.g. that every checkpoint
    was invalid and the attempt starts from step 0)."""
    job = require_job(rd)
    job.attempts[index].notice = notice
    write_job(rd, job)


def record_fork(rd: RunDirectory, index: int, run_id: str, from_run_id: str, from_run_dir: str) -> None:
    """Record that attempt `index` found the run directory a copy and went on as a fork with `run_id`."""
    job = require_job(rd)
    fork = Fork(attempt=index, time=now(), run_id=run_id, from_run_id=from_run_id, from_run_dir=from_run_dir)
    job.forks = [*(job.forks or []), fork]
    write_job(rd, job)


def set_run_state(rd: RunDirectory, state: State, reason: str) -> None:
    """Set the run's state and reason (a decision taken after the last attempt ended, e.g. cancelled)."""
    job = require_job(rd)
    job.state, job.reason = state, reason
    write_job(rd, job)


def running_attempt(job: JobRecord) -> Attempt | None:
    """The newest attempt recorded RUNNING on this host whose process still runs (the very process
    recorded, not one that got its pid later), else None."""
    for a in reversed(job.attempts):
        if a.state is State.RUNNING and a.host == os.uname().nodename and process_alive(a.pid, a.pid_start):
            return a
    return None


_SIGNAL_IN_REASON = re.compile(r"\((SIG[A-Z0-9]+)\)")


def _from_format1(raw: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: a STOPPED attempt's stop signal, from the "(SIGxxx)" its reason carries."""
    attempts = []
    for a in raw.get("attempts") or []:
        if isinstance(a, dict) and a.get("state") == State.STOPPED.value and not a.get("stop_signal"):
            if m := _SIGNAL_IN_REASON.search(a.get("reason") or ""):
                a = a | {"stop_signal": m.group(1)}
        attempts.append(a)
    return raw | {"format": FORMAT, "attempts": attempts}


def _damaged(path, problem: str) -> InputError:
    return InputError(str(path), message=f"{path} is damaged ({problem}); it is not a vlmrun job record")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(short_repr(p, 40, quote=False) for p in err['loc'])}: {short_repr(err['msg'], quote=False)}"
