"""Ray inside a job: a private single-machine instance for the embedded default.

Always `address="local"` with a per-job temp dir: a plain `ray.init()` may attach to another user's
Ray on a shared host. Never `ray stop`: it kills every Ray process on the machine. Inside a node
process the temp dir lies under the attempt's temp root, which the attempt's reaper removes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vlmrun.cluster.ray.nodes import SETUP_HOOK_ENV
from vlmrun.cluster.reaper import TEMP_ENV

# Read by Ray and gloo when they are imported / start: set before either happens.
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the node then registers as 127.0.0.1 (docs/measurements.md)
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",  # keep gloo's collectives on loopback, not the machine's outward address
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    **SETUP_HOOK_ENV,
}


def set_local_environment() -> None:
    """Call before importing ray; worker processes inherit these variables."""
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)


def start_local_ray(job_id: str, num_cpus: int) -> Path:
    set_local_environment()
    import ray

    attempt_root = os.environ.get(TEMP_ENV)
    if attempt_root:
        temp = Path(attempt_root) / "ray"
    else:
        temp = Path(tempfile.gettempdir()) / "vlmrun-ray" / job_id.replace("/", "_")[:40]
    temp.mkdir(parents=True, exist_ok=True)
    with _local_node_params():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _temp_dir=str(temp),
            object_store_memory=256 * 1024 * 1024,
            log_to_driver=True,
            configure_logging=False,
        )
    return temp


@contextlib.contextmanager
def _local_node_params() -> Iterator[None]:
    """`ray.init` in the block starts a node whose dashboard agent takes an HTTP port the OS picks, with
    no autoscaler monitor and no API server.

    - The agent's port: Ray's default is the fixed port 52365, and `ray.init` has no argument for it.
      With a second Ray on the machine (another local job, a SLURM job's Ray on a shared node, a
      test's) the port is taken: the agent retries for seconds before it gives up, and the raylet
      registers only after it, so every such `ray.init` waited for it. Nothing of ours talks to that port.
    - The monitor is the autoscaler's: a one-machine Ray of a fixed size has nothing to scale.
    - The API server (`dashboard.py`, started even with `include_dashboard=False`, then without the
      dashboard's pages) serves Ray's job-submission and state APIs over HTTP; vlmrun uses neither
      (the node talks to its actors through the GCS). Each of the two is one more Python process at
      every attempt's start (docs/measurements.md has what they cost).

    `RayParams` (its `dashboard_agent_listen_port` and `no_monitor`) and `Node.start_api_server` are
    Ray's private API (2.60): tests/test_local_ray.py names them, so an upgrade that changes them
    fails there. The SLURM path gives the agent a port of the job's block (nodes.py).
    """
    from ray._private import node, parameter

    params = parameter.RayParams
    api_server = node.Node.start_api_server

    class LocalNodeParams(params):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("dashboard_agent_listen_port", 0)
            kwargs.setdefault("no_monitor", True)
            super().__init__(*args, **kwargs)

    parameter.RayParams = LocalNodeParams
    node.Node.start_api_server = lambda self, **kw: None
    try:
        yield
    finally:
        parameter.RayParams = params
        node.Node.start_api_server = api_server


def stop_local_ray() -> None:
    """`ray.shutdown()` of the instance `start_local_ray` began, without Ray's grace per process.

    Ray ends its processes one after the other (raylet first, then GCS, monitor, dashboard, log
    monitor), each with SIGTERM and up to a second's wait before SIGKILL. Inside a node they start
    with the stop signals blocked (the node's mask, inherited: a SLURM SIGTERM must not end them
    before the checkpoint is written; cluster/spawn.py), so a SIGTERM never arrives and every one of
    those seconds is spent waiting: 5 s at the end of every local attempt, measured. The driver still disconnects first; then SIGKILL, in Ray's order.
    `worker._global_node.kill_all_processes(allow_graceful=...)` is Ray's private API (2.60):
    tests/test_local_ray.py names it, so an upgrade that changes it fails there.
    """
    import ray
    from ray._private import worker

    node = worker._global_node
    if node is not None:
        kill_all = node.kill_all_processes
        node.kill_all_processes = lambda **kw: kill_all(**(kw | {"allow_graceful": False}))
    ray.shutdown()
