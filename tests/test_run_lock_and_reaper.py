"""The run lock, the attempt reaper and the stop flag's signal watcher, with small real processes (fast).

The whole story with real runs (Ray, SIGKILL of a node, Ctrl-C, cancel) is tests/test_chaos_processes.py.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from vlmrun.cluster.reaper import MARKER_ENV, marked_processes, sweep, temp_root_name, wait_for_exit
from vlmrun.run.directory import LOCK_HOLDER_FILE as HOLDER_FILE
from vlmrun.run.lock import FD_ENV, SETTLE_S, Holder, RunLock, RunLocked, live_holder, read_holder
from vlmrun.run.process import process_alive, start_time

ROOT = Path(__file__).resolve().parents[1]


def python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw
    )


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_second_taker_is_refused_at_once_naming_the_live_holder(tmp_path):
    with RunLock.acquire(tmp_path) as lock:
        lock.describe(Holder.of(os.getpid(), "local-7"))
        t0 = time.monotonic()
        with pytest.raises(RunLocked) as e:
            RunLock.acquire(tmp_path)
        assert time.monotonic() - t0 < SETTLE_S / 3  # no settling: the holder is alive
        message = str(e.value)
        assert f"pid {os.getpid()} on {os.uname().nodename} (job local-7" in message
        assert "vlmrun cancel local-7" in message and e.value.exit_code == 2
        assert live_holder(tmp_path).job_id == "local-7"
        copy = tmp_path / "copy"
        copy.mkdir()
        (copy / HOLDER_FILE).write_text((tmp_path / HOLDER_FILE).read_text())
        assert live_holder(copy) is None  # a copied run dir does not run where its original does
    RunLock.acquire(tmp_path).release()  # free again once released


def test_a_handed_over_lock_is_held_by_the_child_and_freed_when_it_is_killed(tmp_path):
    lock = RunLock.acquire(tmp_path)
    child = python(
        f"""
        import time
        from vlmrun.run.lock import RunLock
        assert RunLock.inherited({str(tmp_path)!r}) is not None
        print("holding", flush=True)
        time.sleep(60)
        """,
        env=os.environ | {FD_ENV: str(lock.fd)},
        pass_fds=(lock.fd,),
    )
    lock.release()  # only the child's copy is left
    try:
        assert child.stdout.readline().strip() == "holding"
        with pytest.raises(RunLocked):
            RunLock.acquire(tmp_path, settle_s=0.2)
    finally:
        child.kill()
        child.wait()
    RunLock.acquire(tmp_path, settle_s=0).release()  # the kernel freed it with the process


def test_a_dead_described_holder_is_waited_for_then_named(tmp_path):
    holder = python(
        f"""
        import time
        from vlmrun.run.lock import RunLock
        RunLock.acquire({str(tmp_path)!r})
        print("locked", flush=True)
        time.sleep(60)
        """
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        dead = Holder(pid=2**22 + 12345, host=os.uname().nodename, job_id="local-gone")
        (tmp_path / HOLDER_FILE).write_text(json.dumps(asdict(dead)))
        t0 = time.monotonic()
        with pytest.raises(RunLocked) as e:
            RunLock.acquire(tmp_path, settle_s=0.5)  # a dying holder's lock usually comes free: wait first
        assert time.monotonic() - t0 >= 0.5 and "local-gone" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    assert read_holder(tmp_path) == dead


def test_alive_means_this_very_process_running_not_its_pid_nor_a_zombie():
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = start_time(child.pid)
        assert start is not None and process_alive(child.pid) and process_alive(child.pid, start)
        assert not process_alive(child.pid, start + 1)  # a later process that got the same pid
        child.kill()
        wait_for(lambda: not process_alive(child.pid))  # killed, not yet reaped: a zombie is not alive
        assert child.poll() is not None
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid, start) and start_time(2**22 + 12345) is None
    assert not process_alive(None) and not process_alive(0) and not process_alive(-1)


def test_a_holder_whose_pid_was_reused_is_not_the_holder(tmp_path):
    """lock.json names a live pid with another start time: the holder died and its pid went to another
    process; the lock is not refused at once as held by a live process (it is waited for, then taken)."""
    reused = Holder.of(os.getpid(), "local-old")
    reused = Holder(reused.pid, reused.host, reused.job_id, reused.since, reused.start + 1)
    (tmp_path / HOLDER_FILE).write_text(json.dumps(asdict(reused) | {"run_dir": str(tmp_path.resolve())}))
    assert reused.alive() is False and live_holder(tmp_path) is None
    RunLock.acquire(tmp_path, settle_s=0).release()


def test_the_reaper_takes_a_reused_pid_for_an_ended_node():
    t0 = time.monotonic()
    wait_for_exit(os.getpid(), start_time(os.getpid()) + 1)  # our pid, another start: the node is gone
    assert time.monotonic() - t0 < 10  # returned: it would wait for this process's end, forever


def test_the_reaper_imports_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import vlmrun.cluster.reaper; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == str(
        ["vlmrun", "vlmrun.cluster", "vlmrun.cluster.reaper", "vlmrun.run", "vlmrun.run.process"]
    )


def test_sweep_kills_only_the_marked_processes_and_removes_the_temp_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    mine, theirs = secrets.token_hex(6), secrets.token_hex(6)
    marked = [subprocess.Popen(["sleep", "60"], env=os.environ | {MARKER_ENV: mine}) for _ in range(2)]
    other = subprocess.Popen(["sleep", "60"], env=os.environ | {MARKER_ENV: theirs})
    try:
        assert sorted(marked_processes(mine)) == sorted(p.pid for p in marked)
        assert sweep(mine, [root]) == 2
        assert [p.wait(timeout=5) for p in marked] == [-signal.SIGKILL] * 2
        assert other.poll() is None and not root.exists()
    finally:
        for p in (*marked, other):
            p.kill()
            p.wait()


def test_sweep_also_kills_a_process_that_lost_the_marker_but_holds_a_file_of_the_attempt(tmp_path):
    """Ray's agents retitle themselves, which writes over what /proc/PID/environ shows; a file they hold
    open under the attempt's temp root (their logs, deleted or not) still names them as the attempt's."""
    mine, theirs = secrets.token_hex(6), secrets.token_hex(6)
    roots = {m: tmp_path / temp_root_name(m) for m in (mine, theirs)}
    clean = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
    started = []
    for root in roots.values():
        root.mkdir()
        with open(root / "agent.out", "w") as log:  # the child keeps it open as its stdout
            started.append(subprocess.Popen(["sleep", "60"], stdout=log, env=clean))
    (roots[mine] / "agent.out").unlink()  # the temp root may be half removed already: a deleted file counts
    try:
        assert marked_processes(mine) == [started[0].pid]
        assert sweep(mine, [roots[mine]]) == 1
        assert started[0].wait(timeout=5) == -signal.SIGKILL and started[1].poll() is None
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_reaper_ends_the_attempt_when_its_node_is_killed():
    node = python(
        """
        import subprocess
        from vlmrun.cluster.reaper import AttemptScope
        scope = AttemptScope.open()
        scope.start_reaper()
        scope.enter()
        subprocess.Popen(["sleep", "60"], start_new_session=True)  # like Ray's daemons: another session
        child = subprocess.Popen(["sleep", "60"])
        print(scope.marker, scope.temp_root, flush=True)
        child.wait()
        """
    )
    marker, root = node.stdout.readline().split()
    wait_for(lambda: len(marked_processes(marker)) == 2)  # a child just started may not show its marker yet
    assert Path(root).is_dir()
    node.kill()
    node.wait()
    t0 = time.monotonic()
    wait_for(lambda: not marked_processes(marker) and not Path(root).exists())
    assert time.monotonic() - t0 < 10


def test_the_reaper_s_guard_sweeps_when_the_reaper_dies_with_the_node():
    """Node and reaper SIGKILLed together: the guard (a second reaper) still ends every process of the
    attempt, one that ignores SIGTERM included, removes the temp root, and then exits itself."""
    node = python(
        """
        import subprocess, sys
        from vlmrun.cluster.reaper import AttemptScope
        scope = AttemptScope.open()
        reaper = scope.start_reaper()
        scope.enter()
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
        subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
        child = subprocess.Popen(["sleep", "60"])
        print(scope.marker, scope.temp_root, reaper.pid, flush=True)
        child.wait()
        """
    )
    marker, root, reaper = node.stdout.readline().split()
    wait_for(lambda: len(marked_processes(marker)) == 2)
    guard = [p for p in _reapers(marker) if p != int(reaper)]
    assert len(guard) == 1, _reapers(marker)
    os.kill(int(reaper), signal.SIGKILL)
    node.kill()
    node.wait()
    t0 = time.monotonic()
    wait_for(lambda: not marked_processes(marker) and not Path(root).exists())
    assert time.monotonic() - t0 < 10
    wait_for(lambda: not _reapers(marker))  # the guard is done too


def _reapers(marker: str) -> list[int]:
    """The reaper and guard processes of `marker` still running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if b"vlmrun.cluster.reaper" in cmd and marker.encode() in cmd and not zombie:
            found.append(int(pid))
    return found


def test_attempt_scope_sends_temp_files_under_its_root():
    code = """
        import subprocess, sys
        from vlmrun.cluster.reaper import AttemptScope
        scope = AttemptScope.open()
        scope.enter()
        mkdtemp = [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp())"]
        print(scope.temp_root, subprocess.run(mkdtemp, capture_output=True, text=True).stdout.strip())
        scope.sweep()
        print(scope.temp_root.exists())
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT)
    root, child_tmp, exists = out.stdout.split()
    assert child_tmp.startswith(root + "/") and len(root) <= 40 and exists == "False"


WATCH = """
    import os, signal, subprocess, sys, threading, time
    from vlmrun.algorithms.common.stop import StopFlag
    if sys.argv[1] == "early":
        os.kill(os.getpid(), signal.SIGTERM)  # blocked since exec: it waits for `watch`
    flag = StopFlag().watch()
    child = subprocess.Popen(["sleep", "30"])  # started after watch: stop signals must not end it
    for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        os.kill(child.pid, s)
    sent = time.monotonic()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2)).start()
    time.sleep(2)  # the main thread sits in a C call: the flag must not wait for it
    print(flag.signal_name, child.poll(), flush=True)
    child.kill()
"""


@pytest.mark.parametrize("when", ["early", "later"])
def test_stop_flag_watch_takes_every_signal_at_once_and_children_survive_them(when):
    """Started with the signals blocked, as the launcher starts a node: a signal sent before `watch` counts."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WATCH), when],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR2, signal.SIGINT}),
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.split() == ["SIGTERM" if when == "early" else "SIGUSR2", "None"]  # the child lives on
