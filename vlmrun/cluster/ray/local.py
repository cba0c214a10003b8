"""Ray inside a job: a private single-machine instance for the embedded default.

Always `address="local"` with a per-job temp dir: a plain `ray.init()` may attach to another user's
Ray on a shared host. Never `ray stop`: it kills every Ray process on the machine. Inside a node
process the temp dir lies under the attempt's temp root, which the attempt's reaper removes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vlmrun.cluster.reaper import TEMP_ENV

# Read by Ray and gloo when they are imported / start: set before either happens.
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the node then registers as 127.0.0.1 (docs/measurements.md)
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",  # keep gloo's collectives on loopback, not the machine's outward address
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
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
