"""The run lock: one live attempt per run directory.

1. The process that trains holds an exclusive `flock` on `<run dir>/lock` for its life. The kernel
   releases it when the last descriptor of the locked open file closes, whatever ended the process
   (SIGKILL included), so a lock left by a dead process never blocks a resume.
2. `lock.json` beside it describes the holder (pid, host, job id, since, the process start time
   against pid reuse). It serves messages and liveness checks only; the flock alone says "held".
3. A local launcher takes the lock before its first write and hands the locked open file to the node
   process (`pass_fds` and FD_ENV); node 0 of a SLURM job takes it when the job starts. A second
   submit, resume or job that finds it held is refused with RunLocked (exit 2), naming the holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.run.directory import LOCK_FILE, LOCK_HOLDER_FILE, write_atomic
from vlmrun.run.process import process_alive, start_time

FD_ENV = "VLMRUN_RUN_LOCK_FD"  # the locked descriptor a launcher handed to the node process
SETTLE_S = 15.0  # how long a lock whose described holder is not alive here may take to come free
_POLL_S = 0.05


@dataclass(frozen=True)
class Holder:
    """A process that holds (or held) a run lock, as `lock.json` describes it."""

    pid: int
    host: str
    job_id: str | None = None
    since: str | None = None
    start: int | None = None  # the process start time (clock ticks since boot): a reused pid differs

    @classmethod
    def of(cls, pid: int, job_id: str | None = None) -> Holder:
        """Describe process `pid` of this host (the caller or its child)."""
        return cls(
            pid=pid,
            host=os.uname().nodename,
            job_id=job_id,
            since=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            start=start_time(pid),
        )

    def alive(self) -> bool | None:
        """True while the process runs on this host; None when it runs on another host (unknowable here)."""
        if self.host != os.uname().nodename:
            return None
        return process_alive(self.pid, self.start)

    def describe(self) -> str:
        job = f"job {self.job_id}, " if self.job_id else ""
        return f"pid {self.pid} on {self.host} ({job}since {self.since})"


class RunLocked(InputError):
    """Another process holds the run directory's lock: one attempt at a time may run in it (exit 2)."""

    def __init__(self, run_dir: Path, holder: Holder | None):
        self.holder = holder
        who = holder.describe() if holder else "a process that left no description"
        cancel = holder.job_id if holder and holder.job_id else run_dir
        super().__init__(
            "RUN_DIR",
            str(run_dir),
            message=f"{run_dir} is in use by {who}; one attempt at a time may run in a run directory: "
            f"wait for it to end or `vlmrun cancel {cancel}`",
        )


class RunDirNotWritable(InputError):
    """The run directory cannot be written (a read-only file system, no permission): nothing that
    writes into a run (an attempt, a resume) can start in it (exit 2)."""

    def __init__(self, run_dir: Path, error: OSError):
        super().__init__(
            "RUN_DIR",
            str(run_dir),
            message=f"RUN_DIR: {run_dir} is not writable ({error.strerror}); a resume writes its attempt into "
            "the run directory: make it writable, or copy it to a writable place and resume the copy",
        )


def read_holder(run_dir: Path) -> Holder | None:
    """The holder `lock.json` describes (it may be dead: the description outlives the lock)."""
    raw = _read_description(Path(run_dir))
    try:
        return Holder(**{k: raw.get(k) for k in Holder.__dataclass_fields__}) if raw else None
    except TypeError:
        return None


def live_holder(run_dir: Path) -> Holder | None:
    """The described holder when it is alive on this host and described this very run dir (not the
    original of a copy), i.e. the attempt that runs here now; else None."""
    raw = _read_description(Path(run_dir))
    if not raw or raw.get("run_dir") != str(Path(run_dir).resolve()):
        return None
    holder = read_holder(run_dir)
    return holder if holder is not None and holder.alive() else None


def _read_description(run_dir: Path) -> dict | None:
    try:
        raw = json.loads((run_dir / LOCK_HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


class RunLock:
    """The exclusive lock of one run directory, held while this descriptor (or a copy of it) is open."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = Path(run_dir), fd

    @property
    def fd(self) -> int:
        return self._fd

    @classmethod
    def acquire(cls, run_dir: Path, *, settle_s: float = SETTLE_S) -> RunLock:
        """Take the lock of `run_dir` (created if missing); raises RunLocked naming the holder, or
        RunDirNotWritable when the lock file cannot be opened for writing (a read-only run directory).

        Refuses at once when the described holder is alive on this host. Otherwise (it died and its
        reaper is still ending its processes, its launcher has not described it yet, or it runs on
        another host) waits up to `settle_s` for the lock to come free.
        """
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise RunDirNotWritable(run_dir, e) from None
        deadline = time.monotonic() + settle_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return cls(run_dir, fd)
            except BlockingIOError:
                pass
            holder = read_holder(run_dir)
            if (holder is not None and holder.alive()) or time.monotonic() >= deadline:
                os.close(fd)
                raise RunLocked(run_dir, holder)
            time.sleep(_POLL_S)

    @classmethod
    def inherited(cls, run_dir: Path) -> RunLock | None:
        """The lock a launcher handed to this process (FD_ENV, removed from the environment), or None.

        Returns None when the descriptor is not `run_dir`'s lock file; raises RunLocked when another
        open file of it holds the lock.
        """
        raw = os.environ.pop(FD_ENV, None)
        if raw is None:
            return None
        fd = int(raw)
        try:
            mine, want = os.fstat(fd), os.stat(Path(run_dir) / LOCK_FILE)
        except OSError:
            return None
        if (mine.st_dev, mine.st_ino) != (want.st_dev, want.st_ino):
            return None
        os.set_inheritable(fd, False)  # only this process holds it: the lock ends with it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op on the open file that holds it
        except BlockingIOError:
            os.close(fd)
            raise RunLocked(Path(run_dir), read_holder(Path(run_dir))) from None
        return cls(Path(run_dir), fd)

    def describe(self, holder: Holder) -> None:
        """Write who holds the lock into `lock.json` (for messages, `status` and `cancel`)."""
        text = json.dumps(asdict(holder) | {"run_dir": str(self.run_dir.resolve())}, sort_keys=True)
        write_atomic(self.run_dir / LOCK_HOLDER_FILE, text + "\n")

    def release(self) -> None:
        """Close this descriptor; the lock is free once no other copy of it is open. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
