"""The controller of each training algorithm (`train.algorithm`), the node's one lookup.

Each is a `StepLoop` (common/loop.py) that `common/driver.run_controller` starts; a new algorithm is a
new entry. Imported when chosen: a controller pulls in torch and its workers.
"""

from __future__ import annotations

from vlmrun.config.registry import load_entry

#: train.algorithm -> "module:class" of its controller.
CONTROLLERS = {
    "sft": "vlmrun.algorithms.sft.controller:SftController",
    "grpo": "vlmrun.algorithms.grpo.controller:GrpoController",
}


def controller_class(algorithm: str) -> type:
    """The controller class of `algorithm`; InputError naming `train.algorithm` for one there is none of."""
    return load_entry(CONTROLLERS, algorithm, "train.algorithm")
