"""Ray inside a job: a private single-machine instance for the embedded default.

Always `address="local"` with a per-job temp dir: a plain `ray.init()` may attach to another user's
Ray on a shared host. Never `ray stop`: it kills every Ray process on the machine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def start_local_ray(job_id: str, num_cpus: int) -> Path:
    import ray

    # Keep a single-machine Ray on loopback (FACTS: nodes then register as 127.0.0.1).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp = Path(tempfile.gettempdir()) / "vlmrun-ray" / job_id.replace("/", "_")[:40]
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp),
             object_store_memory=256 * 1024 * 1024, log_to_driver=True, configure_logging=False)
    return temp
