"""The cyclic garbage collector paused while a Ray worker process of ours starts.

A rank's start-up imports torch, transformers, a model family's modules and Energon: millions of
objects, all alive until the process ends, which the collector walks again and again meanwhile. That
was 25-30% of the CPU a rank spends on its imports here (3.0-3.6 s against 4.2-4.6 s with the
collector on, the same imports), and every attempt starts three or more such processes; on a busy
host (the suite's 2 CPUs, a shared login node) that CPU is what the attempt waits for.

`pause_in_ray_workers()` runs when `vlmrun` is first imported (its `__init__`): in a Ray worker process
(whose `__main__` is Ray's `default_worker.py`) it turns collection off. `resume()` turns it on again:
`freeze_heap()` calls it once the controller, a rank or a TransferQueue server of ours has set up,
after its one collection; a worker that never gets there (an actor of a tool, a test's) has it back
after `PAUSE_LIMIT_S` all the same. That collection walks only what set-up made: a controller and a
rank call `freeze_imports()` as their construction begins, once their module's imports are done.

The command line does the same for its first `COMMAND_PAUSE_S` (`pause_for_command`, from `vlmrun.cli`'s
entry point): the commands that import torch and transformers in the user's process (`export`, `eval`,
`data check`, `submit`'s data checks) spent 5-25% of their CPU in the collector meanwhile (`vlmrun
export` of a tiny run through this entry point, 4 interleaved rounds beside a CI run: 0.76-0.96x the
CPU with the pause as without it, median ~0.9; docs/measurements.md). So does the node process
(`vlmrun.cluster.node`): it imports Ray, and on a run's first attempt torch and transformers too when it
builds the tiny model (~0.2 s of CPU in the collector at every attempt's start, ~0.8 s when it builds).
Every other process (tools, tests) is left as it is.
"""

from __future__ import annotations

import gc
import sys
import threading

#: The longest the collector stays off in a worker that never says its set-up is done.
PAUSE_LIMIT_S = 120.0
#: How long the command line runs with the collector off: its imports and set-up, not a long command's work.
COMMAND_PAUSE_S = 20.0

_paused = False


def in_ray_worker() -> bool:
    return getattr(sys.modules.get("__main__"), "__file__", "").endswith("default_worker.py")


def pause_in_ray_workers() -> None:
    if in_ray_worker():
        _pause(PAUSE_LIMIT_S)


def pause_for_command() -> None:
    """Collection off for the first COMMAND_PAUSE_S of the command line or a node process (or until `resume()`)."""
    _pause(COMMAND_PAUSE_S)


def _pause(limit_s: float) -> None:
    global _paused
    if _paused or not gc.isenabled():
        return
    gc.disable()
    _paused = True
    timer = threading.Timer(limit_s, resume)
    timer.daemon = True
    timer.start()


def resume() -> None:
    """Collection on again, if `pause_in_ray_workers` turned it off (idempotent)."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()


def freeze_imports() -> None:
    """Leave every object alive now out of all later collections, without collecting first: for an actor
    of ours as its construction begins, its class's module imports done (torch, Ray, vlmrun: ~0.3 M
    objects in a rank, nearly all of a controller's).

    `freeze_heap`'s one collection at the end of set-up then walks only what set-up made (a rank's
    model classes, model and loader), not the imports again: 0.38 -> ~0.2 s of CPU in a tiny rank,
    0.16 -> ~0 in a controller, at every attempt. What the imports left as cyclic garbage by then
    (at most a few thousand small objects: module-level temporaries) stays allocated for the process's
    life; Python's documentation of `gc.freeze` gives the same trade for a parent about to fork.
    """
    gc.freeze()


def freeze_heap() -> None:
    """Collect once, then leave every object alive now out of all later collections (`gc.freeze`).

    A training process holds millions of long-lived objects (torch, transformers, Ray); a full
    collection walks them all: a pause of ~0.2 s at whichever step the collector's counters come due
    (measured on the GRPO controller: one step in ten, 0.2 s longer). Call it once set-up is done;
    what is made later is collected as usual. In a Ray worker whose start-up paused the collector it
    runs again from here.
    """
    gc.collect()
    gc.freeze()
    resume()
