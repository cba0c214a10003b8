"""The vlmrun CLI as a user's process: the one way the tests run `vlmrun ...`, and what they read back.

`vlmrun(...)` runs a command to its end; `Launcher` starts one in a session of its own (as from a
terminal) for tests that signal or kill it. The readers below look at a run directory the way a user
would: job.json, metrics.jsonl, the checkpoints that are sealed, the attempt's processes (found by the
marker on its reaper's command line, so other runs on the host never count).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from vlmrun.run.metrics import history

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
GRPO = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    # read at call time: a test's monkeypatched VLMRUN_JOBS_DIR, and the session's shared tiny models and
    # user cache (conftest.py), reach the command
    now = {k: os.environ[k] for k in ("VLMRUN_JOBS_DIR", "VLMRUN_TINY_MODELS", "XDG_CACHE_HOME") if k in os.environ}
    return ENV | now | (extra or {})


def command(*args: str) -> list[str]:
    """The command line of `vlmrun ARGS` (this interpreter, this checkout's package)."""
    return [sys.executable, "-m", "vlmrun.cli", *args]


def vlmrun(
    *args: str, cwd: Path | str = ROOT, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`vlmrun ARGS` to its end, output captured as text; `env` adds to the environment."""
    return subprocess.run(command(*args), capture_output=True, text=True, env=_env(env), cwd=cwd, timeout=timeout)


def node(run: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The job's node process started directly on `run`, as SLURM or the local launcher would."""
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cluster.node", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        env=_env(None),
        cwd=ROOT,
        timeout=timeout,
    )


def sets(*items: str, **pairs: object) -> list[str]:
    """`--set` arguments: each of `items` ("key=value"), then each of `pairs` (key__sub=value for key.sub)."""
    all_items = [*items, *(f"{k.replace('__', '.')}={v}" for k, v in pairs.items())]
    return [arg for item in all_items for arg in ("--set", item)]


class Launcher:
    """`vlmrun ARGS` in a session of its own (as from a terminal), stdout and stderr kept in files
    `<folder>/<name>.out` and `.err`."""

    def __init__(self, folder: Path, *args: str, name: str = "launcher", env: dict[str, str] | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.out_file, self.err_file = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out_file, "w") as out, open(self.err_file, "w") as err:
            self.proc = subprocess.Popen(
                command(*args), stdout=out, stderr=err, env=_env(env), cwd=ROOT, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ctrl_c(self) -> None:
        """What the terminal sends its foreground process group on Ctrl-C."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float = 300) -> int:
        """The exit code; whatever of its session is still running is SIGKILLed after it."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_group()

    def stdout(self) -> str:
        return self.out_file.read_text()

    def stderr(self) -> str:
        return self.err_file.read_text()


def wait_for(predicate: Callable, timeout: float, what: str, poll: float = 0.05):
    """The first true value of `predicate()`, polled every `poll` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


# ---------------------------------------------------------------- what a run directory says


def job(run: Path) -> dict:
    return json.loads((run / "job.json").read_text())


def states(run: Path) -> list[str]:
    return [a["state"] for a in job(run)["attempts"]]


def last_step(run: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first)."""
    path = run / "metrics.jsonl"
    h = history(path) if path.is_file() else {}
    return max(h) if h else 0


def rows(run: Path) -> list[dict]:
    """Every row of metrics.jsonl, as written (a resumed attempt's rows after the first's)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rows_of(run: Path, attempt: int) -> dict[int, dict]:
    """step -> the row attempt `attempt` wrote for it."""
    return {r["step"]: r for r in rows(run) if r["attempt"] == attempt}


def checkpoints(run: Path) -> list[str]:
    """The checkpoint folders in the run's checkpoints folder (step_N, tmp_step_N, damaged_step_N-...)."""
    folder = run / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def sealed(run: Path) -> list[int]:
    """The steps whose checkpoint is complete (its manifest written last)."""
    folder = run / "checkpoints"
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if (p / "manifest.json").is_file())


def same_history(got: Path, want: Path, keys=("loss", "grad_norm", "lr", "valid_tokens", "sample_ids")) -> None:
    """Both runs' metrics hold the same steps, and at each the same `keys`, bit for bit."""
    a, b = history(got / "metrics.jsonl"), history(want / "metrics.jsonl")
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for step in b:
        for key in keys:
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


def refused(out: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, one or two lines on stderr (the first `error: ...`) naming each of `words`, no traceback;
    returns stderr."""
    err = out.stderr
    assert out.returncode == 2, out.stdout[-3000:] + err[-3000:]
    lines = err.strip().splitlines()
    assert "Traceback" not in err and 1 <= len(lines) <= 2 and lines[0].startswith("error: "), err[-3000:]
    for word in words:
        assert word in err, (word, err)
    return err


# ---------------------------------------------------------------- the processes of an attempt


def node_pid(run: Path, timeout: float = 120) -> int:
    """The pid of the run's live node process, once the run lock describes it (as soon as it started;
    a lock.json left by an earlier attempt names a process that is gone)."""
    import psutil

    def holder():
        try:
            pid = json.loads((run / "lock.json").read_text())["pid"]
            return pid if "vlmrun.cluster.node" in psutil.Process(pid).cmdline() else None
        except (OSError, ValueError, KeyError, psutil.Error):
            return None

    return wait_for(holder, timeout, "the node to start")


def reaper_of(node: int, timeout: float = 30) -> tuple[str, Path, int]:
    """(marker, temp root, pid) of the node's reaper (not its guard), from the reaper's command line."""
    import psutil

    def find():
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "vlmrun.cluster.reaper" in cmd and "--after" not in cmd and cmd[cmd.index("--pid") + 1] == str(node):
                return cmd[cmd.index("--marker") + 1], Path(cmd[cmd.index("--temp-root") + 1]), p.pid
        return None

    return wait_for(find, timeout, "the node's reaper")


def census(marker: str) -> dict[int, str]:
    """pid -> name of every live process of the attempt with `marker`."""
    import psutil

    from vlmrun.cluster.reaper import marked_processes

    found = {}
    for pid in marked_processes(marker):
        with contextlib.suppress(psutil.Error):
            found[pid] = psutil.Process(pid).name()
    return found


def signal_attempt(node: int, signum: int) -> None:
    """`signum` to the node and every process of its attempt (what `scancel --signal=...` does on SLURM)."""
    from vlmrun.cluster.reaper import marked_processes

    marker, _, _ = reaper_of(node)
    for pid in [node, *marked_processes(marker)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def alive(seen: dict[int, str]) -> list[int]:
    """The processes of `seen` (pid -> name) still running: same pid and name, not a zombie."""
    import psutil

    running = []
    for pid, name in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.name() == name and p.status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running
