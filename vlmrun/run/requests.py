"""Requests to a running job, written into its run directory (REQUEUE_REQUESTED, CANCEL_REQUESTED).

A request names the job id and, when the requester knew it, the restart count of the attempt it was
meant for: a request that arrived too late for one attempt cannot steer the next one.
"""

from __future__ import annotations

import json
from pathlib import Path

# The request file names live with the run directory's other names (directory.RUN_NAMES).
from vlmrun.run.directory import CANCEL_REQUEST, REQUEUE_REQUEST, RunDirectory, write_atomic

__all__ = ["CANCEL_REQUEST", "REQUEUE_REQUEST", "take_request", "write_request"]


def take_request(rd: RunDirectory, name: str, job_id: str, restart: int) -> bool:
    """True when `name` (REQUEUE_REQUESTED, CANCEL_REQUESTED) was written for this attempt; removes it.

    A request names the job id and, when the requester knew it, the restart count of the attempt it
    was meant for: a request that arrived too late for one attempt cannot steer the next one.
    """
    path = rd.path / name
    try:
        request = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    path.unlink(missing_ok=True)
    return str(request.get("job_id")) == str(job_id) and request.get("restart") in (None, restart)


def write_request(rd: RunDirectory, name: str, job_id: str, restart: int | None = None) -> Path:
    from vlmrun.run.job import now

    path = rd.path / name
    write_atomic(path, json.dumps({"job_id": str(job_id), "restart": restart, "time": now()}) + "\n")
    return path
