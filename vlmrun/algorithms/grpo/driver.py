"""The GRPO driver: the common driver (algorithms/common/driver.py) with the GRPO controller.

`plane_endpoint` is what the job's data-plane servers hand out (cluster/plane_servers.py,
`running_plane_servers`): None for `data_plane.impl: local` or a disabled plane.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlmrun.algorithms.common.driver import run_controller
from vlmrun.algorithms.common.stop import StopFlag
from vlmrun.run.directory import RunDirectory


def run_grpo(
    rd: RunDirectory,
    recipe,
    *,
    attempt: int,
    model_dir: Path,
    stop: StopFlag,
    plane_endpoint=None,
    on_row: Callable[[dict], None] | None = None,
    worker_threads: int = 1,
    started_at: float | None = None,
    chosen=None,
):
    """Run (or continue) the GRPO loop of `recipe` in the Ray instance this process is connected to;
    returns the attempt's RunOutcome."""
    from vlmrun.algorithms.grpo.controller import GrpoController

    return run_controller(
        GrpoController,
        rd,
        recipe,
        attempt=attempt,
        model_dir=model_dir,
        stop=stop,
        on_row=on_row,
        worker_threads=worker_threads,
        started_at=started_at,
        chosen=chosen,
        plane_endpoint=plane_endpoint,
    )
