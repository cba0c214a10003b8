"""The job's mooncake_master: ports from the job's block, health-checked start, a stop that leaves nothing,
death named in one line, and no master outliving the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from vlmrun.cluster.mooncake import (
    master_healthy,
    mooncake_ports,
    mooncake_unavailable,
    running_mooncake_master,
    start_mooncake_master,
    stop_mooncake_master,
)
from vlmrun.cluster.ray.nodes import PortBlock, port_block, taken_ports

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_unavailable() is not None, reason=str(mooncake_unavailable())),
]
HOST = "127.0.0.1"


def free_blocks(n: int, start: int = 0) -> list[PortBlock]:
    """`n` port blocks of distinct job ids whose mooncake ports nobody uses now (other test runs share the host)."""
    blocks = []
    for k in range(start, start + 200):
        block = port_block(str(os.getpid() + k))
        if block not in blocks and not taken_ports(HOST, mooncake_ports(block).all()):
            blocks.append(block)
        if len(blocks) == n:
            return blocks
    pytest.skip("no free port block on this host")


def _store(master):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    cfg = master.store_config()
    rc = store.setup(HOST, f"http://{cfg.metadata_server}/metadata", 32 << 20, 16 << 20, "tcp", "", cfg.master_address)
    assert rc == 0
    return store


def test_two_masters_with_two_port_blocks_do_not_collide(tmp_path):
    a_block, b_block = free_blocks(2)
    with (
        running_mooncake_master(a_block, host=HOST, log_path=tmp_path / "a.log") as a,
        running_mooncake_master(b_block, host=HOST, log_path=tmp_path / "b.log") as b,
    ):
        assert master_healthy(a) and master_healthy(b)
        assert not set(a.ports.all()) & set(b.ports.all())
        assert set(a.ports.all()) < set(range(a_block.base, a_block.base + 16))  # the block's fixed part
        store_a, store_b = _store(a), _store(b)
        try:
            assert store_a.put("sample-0@pixel_values", b"\x01\x02\x03") == 0
            assert store_a.get("sample-0@pixel_values") == b"\x01\x02\x03"
            assert store_b.is_exist("sample-0@pixel_values") == 0  # job b's store is its own
        finally:
            store_a.close()
            store_b.close()
        # a third job whose block is a's (local job ids are pids: two can share a block) takes the next
        # block whose master ports are free, and a's master goes on as it was
        c = start_mooncake_master(a_block, host=HOST, log_path=tmp_path / "c.log")
        try:
            assert master_healthy(c) and not set(c.ports.all()) & (set(a.ports.all()) | set(b.ports.all()))
            assert master_healthy(a)
        finally:
            stop_mooncake_master(c)


def test_stopping_the_master_leaves_no_process(tmp_path):
    (block,) = free_blocks(1, start=300)
    master = start_mooncake_master(block, host=HOST, log_path=tmp_path / "m.log")
    pid = master.pid
    assert psutil.Process(pid).name().startswith("mooncake_maste")
    for stop_signal in (signal.SIGTERM, signal.SIGUSR2):  # a job-wide stop is for the node's flag
        os.kill(pid, stop_signal)
    time.sleep(0.5)
    assert master_healthy(master)
    stop_mooncake_master(master)
    assert not psutil.pid_exists(pid)  # reaped, not a zombie
    assert master.proc.returncode is not None
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid == pid]
    assert taken_ports(HOST, master.ports.all()) == []
    stop_mooncake_master(master)  # stopping twice is fine


def test_a_dead_master_is_named_and_none_outlives_its_starter(tmp_path):
    """A SIGKILLed master says so in one line (pid, port, signal, log), and a master whose starter is
    SIGKILLed (a node killed with its reaper) dies at once although it ignores SIGTERM."""
    a_block, b_block = free_blocks(2, start=400)
    master = start_mooncake_master(a_block, host=HOST, log_path=tmp_path / "a.log")
    assert master.exited() is None
    os.kill(master.pid, signal.SIGKILL)
    master.proc.wait(timeout=5)
    assert master.exited() == (
        f"mooncake_master (pid {master.pid}, port {master.ports.rpc} on {HOST}) exited with signal SIGKILL "
        f"(its log: {tmp_path / 'a.log'})"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STARTER), str(b_block.base), str(tmp_path / "b.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    pid = int(starter.stdout.readline())
    assert psutil.Process(pid).name().startswith("mooncake_maste")
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 2
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(pid)


STARTER = """
    import sys, time
    from pathlib import Path
    from vlmrun.cluster.mooncake import start_mooncake_master
    from vlmrun.cluster.ray.nodes import PortBlock
    master = start_mooncake_master(PortBlock(int(sys.argv[1])), host="127.0.0.1", log_path=Path(sys.argv[2]))
    print(master.pid, flush=True)
    time.sleep(60)
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
