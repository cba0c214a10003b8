"""The training driver: start the controller actor, pass on stop requests, show progress, return the outcome."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import ray

from vlmrun.algorithms.common.stop import StopFlag
from vlmrun.errors import VlmrunError
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import RowFollower

log = logging.getLogger(__name__)


def run_sft(
    rd: RunDirectory,
    recipe,
    *,
    attempt: int,
    model_dir: Path,
    stop: StopFlag,
    on_row: Callable[[dict], None] | None = None,
    worker_threads: int = 1,
    started_at: float | None = None,
) -> dict:
    """Run (or continue) the SFT loop of `recipe` in the Ray instance this process is connected to."""
    from vlmrun.algorithms.sft.controller import SftController

    controller = (
        ray.remote(SftController)
        .options(num_cpus=0, max_concurrency=2)
        .remote(
            recipe_json=recipe.model_dump_json(),
            run_dir=str(rd.path),
            attempt=attempt,
            model_dir=str(model_dir),
            worker_threads=worker_threads,
            started_at=started_at,
        )
    )
    ref = controller.run.remote()
    follower = RowFollower(rd.metrics_file(recipe))
    done = threading.Event()
    threading.Thread(target=_forward_stop, args=(stop, done, controller), daemon=True, name="stop-forwarder").start()
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            for row in follower.new_rows():
                if on_row:
                    on_row(row)
            if ready:
                break
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, VlmrunError):
            raise cause from None
        raise
    finally:
        done.set()


def _forward_stop(stop: StopFlag, done: threading.Event, controller) -> None:
    """Wakes as soon as the flag is set (not on a polling tick): steps can be tens of milliseconds."""
    while not done.is_set():
        if stop.wait(timeout=1.0):
            log.info("stop requested (%s): checkpointing at the next step boundary", stop.signal_name)
            controller.request_stop.remote(stop.signal_name or "signal")
            return
