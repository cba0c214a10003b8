"""The training driver: start the controller actor, pass on stop requests, show progress, return the outcome.

The controller runs on this process's Ray node and is told who this process is: once the driver's
process is gone (SIGKILL, node loss), the controller writes no metrics row and no checkpoint more.
The node calls it with the actor class of `train.algorithm`'s controller (algorithms/controllers.py:
`controller_host`, which imports the controller in the actor's process, not in the node).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray

from vlmrun.algorithms.common.stop import StopFlag
from vlmrun.errors import VlmrunError
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import Holder
from vlmrun.run.metrics import RowFollower

log = logging.getLogger(__name__)


def run_controller(
    controller_cls: type,
    rd: RunDirectory,
    recipe,
    *,
    attempt: int,
    model_dir: Path,
    stop: StopFlag,
    on_row: Callable[[dict], None] | None = None,
    worker_threads: int = 1,
    started_at: float | None = None,
    verdict: Future | None = None,
    **controller_kwargs: Any,
):
    """Run (or continue) `controller_cls`'s loop (a `StepLoop`) of `recipe` in the Ray instance this
    process is connected to; returns the attempt's RunOutcome. `controller_kwargs` go to its constructor
    (`chosen`: the checkpoint the node starts from; `plane_endpoint`: the job's data-plane servers).
    `verdict`: a Future of (checkpoint, skipped) the node is still hashing; handed to the controller
    when it is in (the controller loads nothing before)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = (
        ray.remote(controller_cls)
        .options(num_cpus=0, max_concurrency=3, scheduling_strategy=here)  # beside us: it checks our pid
        .remote(
            recipe_json=recipe.model_dump_json(),
            run_dir=str(rd.path),
            attempt=attempt,
            model_dir=str(model_dir),
            worker_threads=worker_threads,
            started_at=started_at,
            driver=Holder.of(os.getpid()),
            awaits_verdict=verdict is not None,
            **controller_kwargs,
        )
    )
    ref = controller.run.remote()
    handoff = VerdictHandoff(controller) if verdict is not None else None
    if handoff is not None:
        verdict.add_done_callback(handoff.hand)
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
            if handoff is not None:
                handoff.check()
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, VlmrunError):
            raise cause from None
        raise
    finally:
        done.set()


class VerdictHandoff:
    """Hands the node's verdict on the checkpoint to the controller, which loads nothing before it: the
    result, or what checking it raised. `check` (the driver's loop calls it) raises `VerdictNotHanded`
    once the handing failed, here (the verdict's Future swallows what its callback raises) or in the
    controller's `checkpoint_verified`: the attempt then fails saying so, where the controller would
    wait for a verdict that never comes for as long as this process lives."""

    def __init__(self, controller):
        self.controller = controller
        self._sent = None  # the ObjectRef of the checkpoint_verified call, once made
        self._failed: BaseException | None = None

    def hand(self, done: Future) -> None:
        try:
            error = done.exception()
            found, skipped = done.result() if error is None else (None, [])
            self._sent = self.controller.checkpoint_verified.remote(found, skipped, error)
        except BaseException as e:  # noqa: BLE001 - reported by check(), on the driver's thread
            self._failed = e

    def check(self) -> None:
        if self._failed is None and self._sent is not None and ray.wait([self._sent], timeout=0)[0]:
            try:
                ray.get(self._sent)
                self._sent = None  # delivered: nothing more to watch
            except Exception as e:  # noqa: BLE001 - the controller's side of the handoff failed
                self._failed = e
        if self._failed is not None:
            e = self._failed
            cause = getattr(e, "cause", None) or e  # a RayTaskError: what the controller's method raised
            raise VerdictNotHanded(
                f"the checkpoint's verdict could not be handed to the controller ({type(cause).__name__}: {cause})"
            ) from e


class VerdictNotHanded(RuntimeError):
    """The node hashed the checkpoint, but the controller never got the verdict (VerdictHandoff)."""


def _forward_stop(stop: StopFlag, done: threading.Event, controller) -> None:
    """Wakes as soon as the flag is set (not on a polling tick): steps can be tens of milliseconds."""
    while not done.is_set():
        if stop.wait(timeout=1.0):
            log.info("stop requested (%s): checkpointing at the next step boundary", stop.signal_name)
            controller.request_stop.remote(stop.signal_name or "signal")
            return
