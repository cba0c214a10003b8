"""The controller of each training algorithm (`train.algorithm`), the node's one lookup.

Each is a `StepLoop` (common/loop.py) that `common/driver.run_controller` starts; a new algorithm is a
new entry. Imported when chosen: a controller pulls in torch and its workers, so the node (which only
starts the controller's actor) takes `controller_host`, a stand-in that imports the controller in the
actor's own process: the node then never imports torch, which would be most of its own CPU.
"""

from __future__ import annotations

from vlmrun.config.registry import load_entry
from vlmrun.errors import InputError

#: train.algorithm -> "module:class" of its controller.
CONTROLLERS = {
    "sft": "vlmrun.algorithms.sft.controller:SftController",
    "grpo": "vlmrun.algorithms.grpo.controller:GrpoController",
}


def controller_class(algorithm: str) -> type:
    """The controller class of `algorithm`; InputError naming `train.algorithm` for one there is none of."""
    return load_entry(CONTROLLERS, algorithm, "train.algorithm")


class _ControllerHost:
    """The controller of `algorithm`, built in the actor's process from the constructor's keywords;
    `run`, `request_stop` and `checkpoint_verified` (what the driver calls) go to it."""

    algorithm: str

    def __init__(self, **kwargs):
        from vlmrun.startup import freeze_imports

        controller = controller_class(self.algorithm)  # imports the controller's module (torch, its workers)
        freeze_imports()  # ... which set-up's one collection then need not walk (vlmrun/startup.py)
        self.loop = controller(**kwargs)

    def run(self):
        return self.loop.run()

    def request_stop(self, reason: str = "signal") -> None:
        self.loop.request_stop(reason)

    def checkpoint_verified(self, found, skipped, error) -> None:
        self.loop.checkpoint_verified(found, skipped, error)


def controller_host(algorithm: str) -> type:
    """An actor class for the controller of `algorithm` that imports nothing of it here. It carries the
    controller's class name, so Ray's process titles and failure headers name the controller as before
    (`ray::SftController.run()`). InputError naming `train.algorithm` for an algorithm there is none of."""
    if algorithm not in CONTROLLERS:
        raise InputError("train.algorithm", algorithm, f"one of {', '.join(sorted(CONTROLLERS))}")
    name = CONTROLLERS[algorithm].rpartition(":")[2]
    return type(name, (_ControllerHost,), {"algorithm": algorithm, "__doc__": _ControllerHost.__doc__})
