"""The attempt marker: the first line of every attempt in a SLURM task log.

submitit appends every attempt of a job to one log file per task; the marker carries the job id and
SLURM_RESTART_COUNT, so `attempt_slice` can cut one attempt out of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

ATTEMPT_MARKER = "==> vlmrun attempt"


_MARKER_RE = re.compile(r"==> vlmrun attempt job=(\S+) restart=(\d+)")


def attempt_slice(lines, job_id: str, restart: int) -> Iterator[str]:
    """The lines from the marker of (job_id, restart) up to the next attempt's marker."""
    inside = False
    for line in lines:
        m = _MARKER_RE.search(line)
        if m:
            inside = m.group(1) == str(job_id) and int(m.group(2)) == restart
        if inside:
            yield line
