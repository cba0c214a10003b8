"""The attempt reaper: when a node process dies, for any reason, nothing it started outlives it.

1. Each node process opens an `AttemptScope` (a marker unique to this attempt on this node, and a
   temp root) and starts the reaper before anything else. Entering the scope puts the marker
   (MARKER_ENV) and TMPDIR into the environment, so every process started later carries the marker
   and keeps its temp files under the root: Ray's head, raylet and agents, the controller and rank
   actors, loader worker processes, wandb.
2. The reaper runs in a session of its own with the stop signals blocked and ignored, so a Ctrl-C or
   a job-wide `scancel --signal` meant for the node leaves it be. It waits for the node to end (a
   pidfd), then `sweep`s: SIGKILL to every process of this user whose environment carries the
   marker, until none is left, then the temp root goes. On node 0 it then records the attempt KILLED
   in job.json (under the run lock) when the node ended without recording how it ended.
   A process whose environment no longer shows the marker still counts when it holds a file open under
   the attempt's temp root: Ray's agents retitle themselves (setproctitle writes over the memory that
   /proc/PID/environ reads), and once their raylet was gone they lived on for a minute without it.
3. The node sweeps too at the end of a normal teardown, so a finished attempt leaves nothing behind
   by the time it exits; the reaper's sweep then finds nothing.
4. A second line for the case where the reaper dies with the node (both SIGKILLed, a kill of every
   process named vlmrun): its guard, a second reaper in a session of its own, waits for the node and
   then for the reaper, and sweeps after them (usually finding nothing). Besides, the job's servers
   die with their parent (mooncake_master: PR_SET_PDEATHSIG) and Ray's processes with Ray's head.

`python -m vlmrun.cluster.reaper` imports only the standard library (and run/process.py, which does too)
until it has to record a kill.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vlmrun.run.process import process_alive, start_time

MARKER_ENV = "VLMRUN_ATTEMPT_MARKER"
TEMP_ENV = "VLMRUN_ATTEMPT_TEMP"  # the attempt's temp root (also TMPDIR inside the attempt)
_SWEEP_S = 10.0


@dataclass(frozen=True)
class AttemptScope:
    """The marker every process of one attempt on one node inherits, and the temp root it writes under."""

    marker: str
    temp_root: Path

    @classmethod
    def open(cls) -> AttemptScope:
        """A new marker and its temp root, short enough for Ray's unix socket paths (107 bytes)."""
        base = Path(tempfile.gettempdir())
        if len(str(base)) > 40:
            base = Path("/tmp")
        marker = secrets.token_hex(6)
        root = base / temp_root_name(marker)
        root.mkdir(mode=0o700, parents=True)
        return cls(marker, root)

    def enter(self) -> None:
        """From now on every process this one starts carries the marker and writes temp files under the root."""
        os.environ[MARKER_ENV] = self.marker
        os.environ[TEMP_ENV] = str(self.temp_root)
        os.environ["TMPDIR"] = str(self.temp_root)
        tempfile.tempdir = str(self.temp_root)

    def start_reaper(
        self,
        *,
        run_dir: Path | None = None,
        job_id: str | None = None,
        console: int | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:
        """Start the reaper of this process and its guard (module doc); with `run_dir` they also
        record a kill of `job_id` in job.json. What they say goes to `console` (a descriptor; default
        this process's stderr) and, given `log`, is appended to that file too. Returns the reaper."""
        env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, TEMP_ENV)}
        me = os.getpid()
        cmd = [sys.executable, "-m", "vlmrun.cluster.reaper", "--pid", str(me), "--marker", self.marker]
        cmd += ["--pid-start", str(start_time(me)), "--temp-root", str(self.temp_root)]
        if run_dir is not None and job_id is not None:
            cmd += ["--run-dir", str(run_dir), "--job-id", job_id]
        if log is not None:
            cmd += ["--log", str(log)]
        start = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        if console is not None:
            start["stderr"] = console
        reaper = subprocess.Popen(cmd, **start)
        subprocess.Popen([*cmd, "--after", str(reaper.pid)], **start)
        return reaper

    def sweep(self) -> int:
        """End every process of this attempt except the caller and remove the temp root; returns how many were killed."""
        return sweep(self.marker, [self.temp_root])


def temp_root_name(marker: str) -> str:
    """The name of the temp root of the attempt with `marker` (in the system's temp dir)."""
    return f"vlmrun-{marker}"


def marked_processes(marker: str) -> list[int]:
    """Pids of this user's live processes (not the caller) of the attempt with `marker`: its environment
    carries the marker, or it holds a file open under the attempt's temp root (module doc)."""
    entry = f"{MARKER_ENV}={marker}".encode()
    inside = f"/{temp_root_name(marker)}/"
    me, uid = os.getpid(), os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z" and (entry in env.split(b"\0") or _holds_file_under(name, inside)):
            found.append(int(name))
    return found


def _holds_file_under(pid: str, inside: str) -> bool:
    """Whether process `pid` has an open file (a deleted one included) whose path contains `inside`."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if inside in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return True
        except OSError:
            continue
    return False


def sweep(marker: str, remove: list[Path], *, deadline_s: float = _SWEEP_S) -> int:
    """SIGKILL the processes carrying `marker` until none is left (or `deadline_s`), then remove `remove`.

    Returns how many processes it killed. Only SIGKILL: our processes ignore the stop signals.
    """
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while (found := marked_processes(marker)) and time.monotonic() < end:
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            killed.add(pid)
        time.sleep(0.05)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)
    return len(killed)


def wait_for_exit(pid: int, start: int | None = None) -> None:
    """Block until process `pid` (not our child) has ended; with `start` (its start time), a process
    that got the pid later counts as ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3): poll
        while process_alive(pid, start):
            time.sleep(0.2)
        return
    try:
        if process_alive(pid, start):  # the pidfd names one process; this says it is the recorded one
            select.select([fd], [], [])
    finally:
        os.close(fd)


def _record_kill(run_dir: Path, job_id: str, pid: int) -> bool:
    """job.json: the node's attempt, still RUNNING, becomes KILLED (under the run lock, so no new attempt races us)."""
    from vlmrun.run import job as job_record
    from vlmrun.run.directory import RunDirectory
    from vlmrun.run.lock import RunLock, RunLocked

    rd = RunDirectory(run_dir)
    job = job_record.read_job(rd)
    if job is None or not any(a.pid == pid and a.state.value == "RUNNING" for a in job.attempts):
        return False
    try:
        with RunLock.acquire(rd.path):
            return job_record.mark_killed(rd, job_id, pid)
    except RunLocked:  # a new attempt holds the run: it records the old one KILLED as it begins
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmrun.cluster.reaper", description=__doc__.splitlines()[0])
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--pid-start", type=lambda v: None if v == "None" else int(v))
    p.add_argument("--marker", required=True)
    p.add_argument("--temp-root", type=Path, required=True)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--job-id")
    p.add_argument("--after", type=int, help="the guard of this reaper: sweep after it ended (module doc)")
    p.add_argument("--log", type=Path, help="the attempt's log: what the reaper says is appended to it too")
    args = p.parse_args(argv)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    reaper = _pidfd(args.after) if args.after else None  # opened now, while that pid is surely the reaper
    wait_for_exit(args.pid, args.pid_start)
    if reaper is not None:
        select.select([reaper], [], [])
        os.close(reaper)
    t0 = time.monotonic()
    killed = sweep(args.marker, [args.temp_root])
    recorded = args.run_dir is not None and _record_kill(args.run_dir, args.job_id, args.pid)
    if killed or recorded:
        who = "vlmrun reaper" + (f" (guard of reaper {args.after}, which died with the node)" if args.after else "")
        _say(
            f"{who}: the node process {args.pid} ended; killed {killed} process(es) of its attempt "
            f"in {time.monotonic() - t0:.1f}s" + (f"; recorded job {args.job_id} KILLED" if recorded else ""),
            args.log,
        )
    return 0


def _say(line: str, log: Path | None) -> None:
    """`line` on stderr and at the end of `log` (either may be gone: the reaper's work is done by now)."""
    if log is not None:
        try:
            with open(log, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once it has ended), or None when it is gone already or pidfds are missing."""
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
