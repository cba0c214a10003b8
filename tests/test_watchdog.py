"""The fail-fast watchdog (cluster/watchdog.py) and what the plane's servers report to it, in-process (fast).

The real deaths (a SIGKILLed storage unit, controller or mooncake_master in a GRPO run) are in
tests/test_grpo_e2e.py; the servers' own reports in tests/test_plane_transfer_queue.py and
tests/test_plane_mooncake_master.py.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from vlmrun.cluster.plane_servers import PlaneServerLost, PlaneServers, watched
from vlmrun.cluster.watchdog import FailFast
from vlmrun.errors import EXIT_CHECK_FAILED, CheckFailed


class Lost(CheckFailed):
    pass


class Server:
    """A check that reports a problem once `die()` was called."""

    def __init__(self) -> None:
        self.dead = threading.Event()

    def die(self, after_s: float = 0.0) -> None:
        threading.Timer(after_s, self.dead.set).start()

    def __call__(self) -> str | None:
        return "the server (pid 7) died" if self.dead.is_set() else None


def test_a_problem_ends_a_polling_body_within_a_period_naming_it():
    server = Server()
    server.die(after_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(Lost, match=r"^the server \(pid 7\) died$") as e:
        with FailFast(server, Lost, period_s=0.05):
            while time.monotonic() - t0 < 5:  # the driver's loop: ray.wait with a timeout
                time.sleep(0.01)
            handler = signal.getsignal(signal.SIGINT)  # interrupt_main raises only through Python's own handler
            raise AssertionError(f"no KeyboardInterrupt within 5 s (SIGINT's handler here: {handler!r})")
    assert e.value.__cause__ is None, e.value.__cause__  # the interrupt is no cause worth a traceback
    assert 0.2 <= time.monotonic() - t0 < 1.0


def test_a_failure_of_the_body_while_a_server_is_gone_is_reported_as_that_death():
    server = Server()
    with pytest.raises(Lost, match="died") as e:
        with FailFast(server, Lost, period_s=60):  # the next check would come too late
            server.dead.set()
            raise RuntimeError("batch_get_into failed for keys ['0@response_ids', '1@response_ids', ...]")
    assert isinstance(e.value.__cause__, RuntimeError)  # kept for the traceback in the log


def test_the_body_s_own_failures_and_a_normal_end_pass_through():
    healthy = Server()
    with pytest.raises(ValueError, match="ours"):
        with FailFast(healthy, Lost, period_s=0.01):
            raise ValueError("ours")
    with FailFast(healthy, Lost, period_s=0.01) as dog:
        time.sleep(0.05)
    assert dog.failure is None
    dog._thread.join(timeout=1)
    assert not dog._thread.is_alive()


def test_a_check_that_cannot_ask_is_no_verdict():
    def unreachable() -> str | None:
        raise ConnectionError("GCS gone")

    with pytest.raises(ValueError, match="ours"):
        with FailFast(unreachable, Lost, period_s=0.01):
            time.sleep(0.05)
            raise ValueError("ours")


class FakeMaster:
    def __init__(self, line: str | None):
        self.line = line

    def exited(self) -> str | None:
        return self.line


class FakeTransferQueue:
    def __init__(self, line: str | None):
        self.line = line

    def lost(self) -> str | None:
        return self.line


def test_the_plane_s_servers_are_one_check_and_its_error_says_how_to_go_on():
    master = "mooncake_master (pid 9, port 15368 on 127.0.0.1) exited with signal SIGKILL (its log: x.log)"
    unit = "the TransferQueue storage unit storage-0 (actor 0123abcd, pid 8 on 127.0.0.1) died"
    assert PlaneServers().lost() is None  # impl local: nothing to watch
    assert PlaneServers(master=FakeMaster(None), transfer_queue=FakeTransferQueue(unit)).lost() == unit
    servers = PlaneServers(master=FakeMaster(master), transfer_queue=FakeTransferQueue(unit))
    assert servers.lost() == master  # the master first: without it the TransferQueue clients fail too
    t0 = time.monotonic()
    with pytest.raises(PlaneServerLost) as e:
        with watched(servers, period_s=0.01):
            while time.monotonic() - t0 < 5:
                time.sleep(0.01)
    assert time.monotonic() - t0 < 1
    assert str(e.value).startswith(master + "; `vlmrun resume` continues from the last checkpoint")
    assert "\n" not in str(e.value) and e.value.exit_code == EXIT_CHECK_FAILED


def test_the_interrupt_reaches_a_body_whose_process_ignores_sigint_and_the_setting_comes_back():
    """A node started in the background of a script inherits SIGINT ignored: interrupt_main would then
    do nothing and the body would run until the hard exit."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = Server()
        server.die(after_s=0.1)
        t0 = time.monotonic()
        with pytest.raises(Lost):
            with FailFast(server, Lost, period_s=0.02):
                while time.monotonic() - t0 < 5:
                    time.sleep(0.01)
        assert time.monotonic() - t0 < 1.0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as it was before the body
    finally:
        signal.signal(signal.SIGINT, previous)
