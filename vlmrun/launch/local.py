"""The embedded default: run the node entrypoint on this machine, no SLURM.

The same entrypoint that every SLURM node runs (`python -m vlmrun.cluster.node`) runs here as a child
process. With `wait`, it shares our process group (a kill of the group ends the run) and we forward
SIGINT/SIGTERM/SIGUSR2 to it; without, it runs detached in its own session and logs to the run dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

from vlmrun.errors import EXIT_BAD_INPUT
from vlmrun.launch.registry import register_job
from vlmrun.launch.result import SubmitResult
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.state import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, State

_OUTCOME = {EXIT_COMPLETED: State.COMPLETED, EXIT_STOPPED: State.STOPPED}


def start_local(rd: RunDirectory, recipe, *, wait: bool, echo: Callable[[str], None] | None = None):
    attempt = job_record.next_attempt(rd)
    cmd = [sys.executable, "-m", "vlmrun.cluster.node", "--run-dir", str(rd.path)]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "VLMRUN_CLUSTER": "local"}
    rd.logs.mkdir(exist_ok=True)  # a copied or pruned run dir may lack it
    if not wait:
        with open(rd.attempt_log(attempt), "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        job_id = f"local-{proc.pid}"
        _record(rd, job_id, recipe)
        if echo:
            echo(f"started {job_id}; run dir {rd.path}\nfollow it with: tail -f {rd.attempt_log(attempt)}")
        return SubmitResult(rd.path, "local", False, job_id=job_id, state=State.RUNNING.value)
    if echo:
        echo(f"run dir {rd.path}")
    # The job's output goes to our stderr: stdout stays clean for `--json`.
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),
        stderr=sys.stderr.fileno(),
        env=env | {"VLMRUN_TEE_LOG": str(rd.attempt_log(attempt))},
    )
    job_id = f"local-{proc.pid}"
    _record(rd, job_id, recipe)
    code = _wait_forwarding_signals(proc)
    state = _OUTCOME.get(code, State.FAILED)
    if echo and code == EXIT_STOPPED:
        echo(f"stopped at a checkpoint; continue with: vlmrun resume {rd.path} --wait")
    passed_on = (EXIT_COMPLETED, EXIT_STOPPED, EXIT_BAD_INPUT)
    return SubmitResult(
        rd.path, "local", False, job_id=job_id, state=state.value, exit_code=code if code in passed_on else EXIT_FAILED
    )


def _record(rd: RunDirectory, job_id: str, recipe) -> None:
    job_record.add_job(rd, job_id, "local", recipe.name)
    register_job(job_id, rd.path)  # so `vlmrun status|logs|requeue local-<pid>` find the run


def _wait_forwarding_signals(proc: subprocess.Popen) -> int:
    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        while True:
            try:
                return proc.wait()
            except InterruptedError:
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
