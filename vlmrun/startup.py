"""The cyclic garbage collector's policy in the processes vlmrun starts; nothing here runs on import.

A process that trains imports torch, transformers, a model family's modules and Energon: millions of
objects that live until the process ends and that the collector would walk again and again while the
imports run, for nothing. So the processes of an attempt, and the command line, run their start-up with
collection off, each asking for it where it starts:

- the command line (`vlmrun.cli.main`) and the node process (`vlmrun.cluster.node`): `pause_for_command`,
  for their first COMMAND_PAUSE_S;
- every Ray worker of a Ray that vlmrun's node starts: `pause_in_worker`, Ray's worker process set-up
  hook (WORKER_SETUP_HOOK, in the environment the node gives its raylets: cluster/ray/nodes.py), which
  runs before the worker imports any actor's code;
- then a controller or a rank calls `freeze_imports` as its construction begins (its imports are done)
  and `freeze_heap` once set up: one collection of what set-up made, everything alive then left out of
  later collections, and collection on again. A worker that never gets there has it back after
  PAUSE_LIMIT_S all the same.

docs/measurements.md has what each of these saves in an attempt's CPU. Library users, tools and tests
that import vlmrun keep their interpreter's collector as it was.
"""

from __future__ import annotations

import gc
import threading

#: Ray's worker process set-up hook for the Ray vlmrun starts (cluster/ray/nodes.py's SETUP_HOOK_ENV).
WORKER_SETUP_HOOK = "vlmrun.startup.pause_in_worker"
#: The longest the collector stays off in a worker that never says its set-up is done.
PAUSE_LIMIT_S = 120.0
#: How long the command line runs with the collector off: its imports and set-up, not a long command's work.
COMMAND_PAUSE_S = 20.0

_paused = False


def pause_in_worker() -> None:
    """Collection off in a Ray worker process until its set-up is done (`freeze_heap`), or PAUSE_LIMIT_S."""
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
    """Collection on again, if a pause turned it off (idempotent)."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()


def freeze_imports() -> None:
    """Leave every object alive now out of all later collections, without collecting first: for an actor
    of ours as its construction begins, its class's module imports done.

    `freeze_heap`'s one collection at the end of set-up then walks only what set-up made (a rank's model
    and loader), not the imports again. What the imports left as cyclic garbage by then (module-level
    temporaries) stays allocated for the process's life: the trade Python's documentation of
    `gc.freeze` describes for a parent about to fork.
    """
    gc.freeze()


def freeze_heap() -> None:
    """Collect once, then leave every object alive now out of all later collections (`gc.freeze`), and
    collection on again if a pause turned it off.

    A training process holds millions of long-lived objects (torch, transformers, Ray); without the
    freeze a full collection walks them all, at whichever step the collector's counters come due. Call
    it once set-up is done; what is made later is collected as usual.
    """
    gc.collect()
    gc.freeze()
    resume()
