"""The job's private local Ray (cluster/ray/local.py): its end waits on no SIGTERM that cannot arrive,
and its start waits on no port another Ray holds.

Inside a node Ray's processes start with the stop signals blocked (the node's mask, inherited), so
`ray.shutdown()` waited a second per process for a SIGTERM they never took before its SIGKILL;
`stop_local_ray` goes to SIGKILL at once. Ray's dashboard agent listens on the fixed port 52365 by
default; a second Ray on the machine then waited ~3.3 s for it at start: ours lets the OS pick (and
starts no autoscaler monitor and no API server: nothing of vlmrun uses them).
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tempfile

import pytest
from vlmrun_cli import ENV, ROOT

CHILD = """
import json, signal, subprocess, time
terminated = []  # every SIGTERM the stop sends, by pid: each would wait for a signal the process cannot take
_terminate = subprocess.Popen.terminate
subprocess.Popen.terminate = lambda self: terminated.append(self.pid) or _terminate(self)
from vlmrun.cluster.spawn import hold_stop_signals
hold_stop_signals(None)  # as a node process starts: the stop signals blocked, for Ray's processes too
from vlmrun.cluster.ray.local import start_local_ray, stop_local_ray
start_local_ray("test-stop", 1)
from ray._private import worker
pids = [i.process.pid for infos in worker._global_node.all_processes.values() for i in infos]
t0 = time.monotonic()
stop_local_ray()
print(json.dumps({"stop_s": time.monotonic() - t0, "pids": pids, "terminated": terminated}))
"""


def test_the_private_api_stop_local_ray_relies_on_is_there():
    from ray._private import node, worker

    assert hasattr(worker, "_global_node")
    assert "allow_graceful" in inspect.signature(node.Node.kill_all_processes).parameters


def test_the_private_api_start_local_ray_relies_on_is_there():
    from ray._private import node, parameter, worker

    assert {"dashboard_agent_listen_port", "no_monitor"} <= set(
        inspect.signature(parameter.RayParams.__init__).parameters
    )
    assert "parameter.RayParams(" in inspect.getsource(worker.init)  # looked up when ray.init runs
    assert "self.start_api_server(" in inspect.getsource(node.Node.start_head_processes)


def test_the_private_api_the_slurm_nodes_ray_start_relies_on_is_there():
    """vlmrun/cluster/ray/start.py: `ray start` in this process, less two of the head's servers."""
    from ray._private import node
    from ray.scripts import scripts

    head = inspect.getsource(node.Node.start_head_processes)
    assert "self.start_api_server(" in head and "self.start_ray_client_server()" in head
    assert callable(scripts.main) and "ray._private.node.Node(" in inspect.getsource(scripts.start.callback)


HOLDER = """
import json, socket, sys, time
from pathlib import Path
held = socket.socket()
held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    held.bind(("127.0.0.1", 52365)); held.listen()  # as another Ray's agent would
except OSError:
    pass  # held by something else already: taken either way
from vlmrun.cluster.ray.local import start_local_ray, stop_local_ray
temp = start_local_ray("test-port", 1)
import ray
from ray._private import worker
processes = sorted(worker._global_node.all_processes)
ray.get(ray.remote(lambda: 1).remote())  # a task still runs without them
stop_local_ray()
logs = [p.read_text() for p in temp.glob("session_*/logs/dashboard_agent.log")]
print(json.dumps({"agent_log": " | ".join(logs), "processes": processes}))
"""


@pytest.mark.slow
def test_a_second_ray_on_the_machine_does_not_wait_for_the_agent_port_the_first_holds_and_starts_no_extras():
    with tempfile.TemporaryDirectory(prefix="vlmrun-", dir="/tmp") as temp:  # Ray's socket paths: short
        env = dict(ENV, TMPDIR=temp)
        out = subprocess.run(
            [sys.executable, "-c", HOLDER], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
        )
    assert out.returncode == 0, out.stderr[-3000:]
    log = json.loads(out.stdout.strip().splitlines()[-1])["agent_log"]
    assert "Dashboard agent grpc address" in log  # the agent started and logged
    assert "Failed to bind" not in log and "failed to bind" not in log, log[-2000:]
    processes = json.loads(out.stdout.strip().splitlines()[-1])["processes"]
    assert "monitor" not in processes and "dashboard" not in processes, processes  # Ray's own names


@pytest.mark.slow
def test_a_ray_that_ignores_sigterm_ends_at_once_and_wholly(tmp_path):
    import psutil

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(d["pids"]) >= 3  # raylet, GCS, log monitor (no autoscaler monitor, no API server)
    assert d["terminated"] == [], d  # ray.shutdown() alone sends each a SIGTERM, then waits a second for it
    assert d["stop_s"] < 10, d  # no wait per process, however busy the machine
    alive = [p for p in d["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
