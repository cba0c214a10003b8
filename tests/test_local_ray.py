"""The job's private local Ray (cluster/ray/local.py): its end waits on no SIGTERM that cannot arrive.

Inside a node Ray's processes start with the stop signals blocked (the node's mask, inherited), so
`ray.shutdown()` waited a second per process for a SIGTERM they never took before its SIGKILL;
`stop_local_ray` goes to SIGKILL at once.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from vlmrun_cli import ENV, ROOT

CHILD = """
import json, signal, time
from vlmrun.cluster.spawn import hold_stop_signals
hold_stop_signals(None)  # as a node process starts: the stop signals blocked, for Ray's processes too
from vlmrun.cluster.ray.local import start_local_ray, stop_local_ray
start_local_ray("test-stop", 1)
from ray._private import worker
pids = [i.process.pid for infos in worker._global_node.all_processes.values() for i in infos]
t0 = time.monotonic()
stop_local_ray()
print(json.dumps({"stop_s": time.monotonic() - t0, "pids": pids}))
"""


def test_the_private_api_stop_local_ray_relies_on_is_there():
    from ray._private import node, worker

    assert hasattr(worker, "_global_node")
    assert "allow_graceful" in inspect.signature(node.Node.kill_all_processes).parameters


@pytest.mark.slow
def test_a_ray_that_ignores_sigterm_ends_at_once_and_wholly(tmp_path):
    import psutil

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(d["pids"]) >= 4  # raylet, GCS, monitor, log monitor (, dashboard)
    assert d["stop_s"] < 2.5, d  # ray.shutdown() alone: about 1 s per process
    alive = [p for p in d["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
