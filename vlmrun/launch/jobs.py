"""`vlmrun status | logs | cancel | requeue`: find a run from a job id or a run dir, ask SLURM, act.

1. Job id -> run dir: a registry file per submitted job, `$VLMRUN_JOBS_DIR/<jobid>` (default
   `~/.cache/vlmrun/jobs/`), holding the run dir path (each submit overwrites its id's entry; an
   entry whose run dir is gone or does not list the id is ignored); failing that, the job's `StdOut`
   from `scontrol show job` (`<run dir>/submitit/<jobid>_0_log.out`) points at the run dir.
2. State: squeue for live jobs, then `scontrol show job` (finished jobs stay known for MinJobAge),
   then sacct (absent without accounting: `sacct` then says "accounting storage is disabled"),
   and job.json, which the job writes itself, for everything else (lineage, attempts, final state).
3. Logs: submitit writes one file per task and job id, appended across restarts; each attempt starts
   with an ATTEMPT_MARKER line carrying its SLURM_RESTART_COUNT, so `logs(..., attempt=N)` is the
   slice of that attempt. Local runs keep `logs/attempt-<N>.log`.
4. `requeue` writes REQUEUE_REQUESTED into the run dir, then `scancel --signal=USR2 <jobid>` (every
   step, not the batch shell): the driver checkpoints at the next step boundary and the job requeues
   with the same job id (see requeue.py). Local runs get SIGUSR2 at the recorded pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

from vlmrun.errors import InputError
from vlmrun.launch import job_record, requeue as requeue_policy
from vlmrun.launch.rundir import RunDirectory, write_atomic

ATTEMPT_MARKER = "==> vlmrun attempt"
_MARKER_RE = re.compile(r"==> vlmrun attempt job=(\S+) restart=(\d+)")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")
LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING")


def jobs_dir() -> Path:
    return Path(os.environ.get("VLMRUN_JOBS_DIR") or Path.home() / ".cache" / "vlmrun" / "jobs")


def register_job(job_id: str, run_dir: Path) -> None:
    """Remember which run dir `job_id` belongs to (for `vlmrun status|logs|cancel|requeue JOBID`)."""
    write_atomic(jobs_dir() / str(job_id), f"{Path(run_dir).resolve()}\n")


def find_run(target: str) -> tuple[RunDirectory, str | None]:
    """(run dir, job id) for a job id or a run dir; raises InputError naming what was tried."""
    path = Path(target).expanduser()
    if path.is_dir():
        rd = RunDirectory(path)
        if not rd.exists():
            raise InputError("JOBID|RUN_DIR", target,
                             message=f"{target} is not a vlmrun run directory (no recipe.yaml)")
        ids = rd.read_job().get("job_ids") or [None]
        return rd, ids[-1]
    entry = jobs_dir() / target
    if entry.is_file():
        rd = RunDirectory(entry.read_text().strip())
        if rd.exists() and target in rd.read_job().get("job_ids", []):  # else a stale entry (run dir gone)
            return rd, target
    if _JOB_ID.match(target):
        found = _run_dir_from_scontrol(target)
        if found:
            return found, target
    raise InputError("JOBID|RUN_DIR", target, message=f"{target}: neither a run directory nor a job id known to vlmrun "
                     f"(registry {jobs_dir()}) or to SLURM")


def _run_dir_from_scontrol(job_id: str) -> RunDirectory | None:
    info = parse_scontrol_job(run_tool(["scontrol", "show", "job", "-o", job_id])[1])
    out = info.get("StdOut", "")
    if "/submitit/" in out:
        rd = RunDirectory(out.rsplit("/submitit/", 1)[0])
        return rd if rd.exists() else None
    return None


# ---------------------------------------------------------------- SLURM queries (pure parsers + one runner)

def run_tool(cmd: list[str], timeout: float = 30) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a SLURM command; 127 when it is missing, 124 on timeout."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{cmd[0]}: timed out after {timeout:g}s"


SQUEUE_FORMAT = "%i|%T|%r|%M|%l|%N"


def parse_squeue(text: str) -> dict[str, dict]:
    """`squeue -h -o '%i|%T|%r|%M|%l|%N'` -> job id -> {state, reason, elapsed, time_limit, nodes}."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6:
            out[parts[0]] = dict(zip(("state", "reason", "elapsed", "time_limit", "nodes"), parts[1:]))
    return out


def parse_scontrol_job(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` -> its Key=Value fields (values end at the next ' Key=')."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return dict(re.findall(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", line))


def parse_sacct(text: str) -> dict[str, dict]:
    """`sacct -n -P -X -o JobID,State,ExitCode,Elapsed` -> job id -> {state, exit_code, elapsed}.

    Without accounting sacct prints "Slurm accounting storage is disabled" (exit 0): that parses to {}.
    """
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            state = parts[1].split()[0] if parts[1] else ""  # "CANCELLED by 0" -> CANCELLED
            out[parts[0]] = {"state": state, "exit_code": parts[2], "elapsed": parts[3]}
    return out


def slurm_state(job_id: str) -> dict | None:
    """SLURM's view of `job_id` (`source`: squeue, scontrol or sacct), or None when SLURM no longer knows it."""
    rc, out, _ = run_tool(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
    if rc == 0 and job_id in (live := parse_squeue(out)):
        return live[job_id] | {"source": "squeue"}
    rc, out, _ = run_tool(["scontrol", "show", "job", "-o", job_id])
    info = parse_scontrol_job(out) if rc == 0 else {}
    if info.get("JobState"):
        return {"state": info["JobState"], "reason": info.get("Reason", ""), "elapsed": info.get("RunTime", ""),
                "exit_code": info.get("ExitCode", ""), "restarts": int(info.get("Restarts", 0) or 0),
                "source": "scontrol"}
    rc, out, _ = run_tool(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Elapsed"])
    row = parse_sacct(out).get(job_id) if rc == 0 else None
    return row | {"source": "sacct"} if row else None


def is_live(job_id: str) -> bool:
    rc, out, _ = run_tool(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
    return rc == 0 and job_id in parse_squeue(out)


# ---------------------------------------------------------------- status

def status(target: str | None = None) -> dict:
    """State of one run (job id or run dir), or of the registered jobs when `target` is None."""
    if target is None:
        entries = sorted(jobs_dir().glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)[:20]
        return {"jobs": [_summary(RunDirectory(p.read_text().strip()), p.name) for p in entries
                         if RunDirectory(p.read_text().strip()).exists()]}
    rd, job_id = find_run(target)
    return _summary(rd, job_id)


def _summary(rd: RunDirectory, job_id: str | None) -> dict:
    job = rd.read_job()
    cluster = job.get("cluster", "local")
    attempts = job.get("attempts", [])
    out = {"run_dir": str(rd.path), "cluster": cluster, "job_id": job_id, "job_ids": job.get("job_ids", []),
           "recorded_state": job.get("state"), "reason": job.get("reason", ""), "attempts": len(attempts),
           "restarts": max([a.get("restart_count", 0) for a in attempts if a.get("job_id") == job_id] or [0]),
           "requeues": requeue_policy.used_budget(job, job_id) if job_id else {}}
    out |= last_metrics(rd)
    if cluster == "slurm" and job_id:
        out["slurm"] = slurm_state(job_id)
        out["state"] = _combined_state(job.get("state"), out["slurm"])
    else:
        pid = job_record.running_pid(job)
        out["pid"] = pid
        out["state"] = "RUNNING" if pid else ("FAILED" if job.get("state") == "RUNNING" else job.get("state"))
    if out["state"] != out["recorded_state"] and out["state"] == "FAILED" and job.get("state") == "RUNNING":
        out["reason"] = "the job ended without recording an outcome (killed?); see `vlmrun logs`"
    return out


def _combined_state(recorded: str | None, slurm: dict | None) -> str | None:
    """SLURM says whether the job is alive; job.json says how a finished run ended."""
    if slurm and slurm["state"] in LIVE:
        return slurm["state"]
    if recorded in ("RUNNING", "PENDING", "REQUEUED", None):
        return slurm["state"] if slurm and slurm["state"] not in ("COMPLETED",) else "FAILED"
    return recorded


def last_metrics(rd: RunDirectory, tail_bytes: int = 65536) -> dict:
    """{last_step, loss} of the newest metrics.jsonl row (reads only the file's tail)."""
    path = rd.metrics_file()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {"last_step": None, "loss": None}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        return {"last_step": row.get("step"), "loss": row.get("loss")}
    return {"last_step": None, "loss": None}


# ---------------------------------------------------------------- logs

def log_file(rd: RunDirectory, job_id: str, task: int = 0) -> Path:
    return rd.path / "submitit" / f"{job_id}_{task}_log.out"


def logs(target: str, attempt: int | None = None, follow: bool = False, *, poll_s: float = 1.0) -> Iterator[str]:
    """Lines of one attempt's log (default: the latest); with `follow`, new lines until the job ends."""
    rd, job_id = find_run(target)
    job = rd.read_job()
    attempts = job.get("attempts", [])
    if attempt is not None and not -len(attempts) <= attempt < len(attempts):
        raise InputError("--attempt", attempt, f"this run has attempts 0..{len(attempts) - 1}" if attempts
                         else "this run has not started an attempt yet")
    chosen = attempts[attempt if attempt is not None else -1] if attempts else {"job_id": job_id, "restart_count": 0}
    if job.get("cluster", "local") != "slurm":
        index = attempts.index(chosen) if attempts else 0
        alive = lambda: job_record.running_pid(rd.read_job()) is not None  # noqa: E731
        yield from _read_lines(rd.attempt_log(index), follow, alive, poll_s)
        return
    path = log_file(rd, chosen["job_id"])
    live = lambda: is_live(chosen["job_id"])  # noqa: E731
    lines = _read_lines(path, follow, live, poll_s)
    if attempt is None and follow:
        yield from lines
    else:
        yield from attempt_slice(lines, chosen["job_id"], int(chosen.get("restart_count", 0)))


def attempt_slice(lines, job_id: str, restart: int) -> Iterator[str]:
    """The lines from the marker of (job_id, restart) up to the next attempt's marker."""
    inside = False
    for line in lines:
        m = _MARKER_RE.search(line)
        if m:
            inside = m.group(1) == str(job_id) and int(m.group(2)) == restart
        if inside:
            yield line


def _read_lines(path: Path, follow: bool, alive, poll_s: float) -> Iterator[str]:
    while follow and not path.exists():
        if not alive():
            return
        time.sleep(poll_s)
    if not path.exists():
        return
    with open(path, errors="replace") as f:
        idle = 0
        while True:
            line = f.readline()
            if line:
                idle = 0
                yield line.rstrip("\n")
                continue
            if not follow:
                return
            idle += 1
            if idle > 2 and not alive():
                return
            time.sleep(poll_s)


# ---------------------------------------------------------------- cancel / requeue

def cancel(target: str, *, wait_s: float = 30.0) -> dict:
    """End the run now (no requeue); job.json says CANCELLED."""
    rd, job_id = find_run(target)
    job = rd.read_job()
    if job.get("cluster") == "slurm":
        requeue_policy.write_request(rd, requeue_policy.CANCEL_REQUEST, job_id, _running_restart(job, job_id))
        rc, _, err = run_tool(["scancel", job_id])
        if rc != 0:
            raise InputError("JOBID", job_id, message=f"scancel {job_id} failed: {err.strip()}")
        deadline = time.monotonic() + wait_s
        while is_live(job_id) and time.monotonic() < deadline:
            time.sleep(0.5)
    else:
        pid = job_record.running_pid(job)
        if pid:
            _end_local(pid, wait_s)
    _mark_cancelled(rd)
    return {"run_dir": str(rd.path), "job_id": job_id, "state": "CANCELLED"}


def _running_restart(job: dict, job_id: str) -> int | None:
    """The restart count of `job_id`'s running attempt, None before its attempt has begun."""
    for a in reversed(job.get("attempts", [])):
        if a.get("job_id") == job_id and a.get("state") == "RUNNING":
            return int(a.get("restart_count", 0))
    return None


def _end_local(pid: int, wait_s: float) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while job_record._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if job_record._alive(pid):
        os.kill(pid, signal.SIGKILL)


def _mark_cancelled(rd: RunDirectory) -> None:
    job = rd.read_job()
    if job.get("state") in ("COMPLETED", "FAILED", "BUDGET_EXHAUSTED"):
        return
    for a in job.get("attempts", []):
        if a.get("state") == "RUNNING":
            a.update(state="CANCELLED", ended=job_record.now(), reason="cancelled by `vlmrun cancel`")
    job.update(state="CANCELLED", reason="cancelled by `vlmrun cancel`")
    rd.write_job(job)


def requeue(target: str) -> dict:
    """Ask a running job to checkpoint at the next step and requeue (same job id, restart count + 1)."""
    rd, job_id = find_run(target)
    job = rd.read_job()
    if job.get("cluster") != "slurm":
        pid = job_record.running_pid(job)
        if not pid:
            raise InputError("JOBID|RUN_DIR", target, message=f"{target} is not running; nothing to requeue")
        os.kill(pid, signal.SIGUSR2)
        return {"run_dir": str(rd.path), "job_id": job_id, "signalled": "SIGUSR2", "pid": pid}
    state = (slurm_state(job_id) or {}).get("state")
    if state != "RUNNING":
        raise InputError("JOBID", job_id, message=f"job {job_id} is {state or 'not known to SLURM'}; only a RUNNING "
                         "job can checkpoint and requeue")
    requeue_policy.write_request(rd, requeue_policy.REQUEUE_REQUEST, job_id, _running_restart(job, job_id))
    rc, _, err = run_tool(["scancel", "--signal=USR2", job_id])
    if rc != 0:
        (rd.path / requeue_policy.REQUEUE_REQUEST).unlink(missing_ok=True)
        raise InputError("JOBID", job_id, message=f"scancel --signal=USR2 {job_id} failed: {err.strip()}")
    return {"run_dir": str(rd.path), "job_id": job_id, "signalled": "SIGUSR2"}
