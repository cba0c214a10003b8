"""The policy: the model being trained, one backend instance per rank (interface.py is the seam).

`open_policy` is the one way to get a backend: the workers, the export and tools/ call it with the
recipe's `model.backend`; no module outside `vlmrun.policy` imports a backend module (an import-linter
contract in pyproject.toml). A new backend is a new entry in `BACKENDS`, not a branch in a caller.
Importing this package loads no torch: the backend's module is imported when it is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlmrun.config.backends import POLICY_BACKENDS, entries
from vlmrun.config.registry import load_entry

if TYPE_CHECKING:
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy.interface import PolicyBackend

#: model.backend -> "module:class" of its PolicyBackend (config/backends.py names them, with what each runs).
BACKENDS = entries(POLICY_BACKENDS)


def open_policy(
    backend: str, *, model: ModelSpec, rank: int, world_size: int, train, parallel=None, gpus: bool = False
) -> PolicyBackend:
    """The `backend` policy for rank `rank` of `world_size` (call `setup` next, or `export`).

    `model` is where its model comes from (a directory, or a config for random init); `train` the
    recipe's train section (optimizer, LR schedule, clipping, seed), `parallel` its parallel section
    (None: replicated, no options), `gpus` whether each rank owns a GPU. Raises InputError naming
    `model.backend` for a backend that is not in BACKENDS.
    """
    cls = load_entry(BACKENDS, backend, "model.backend")
    return cls(model=model, rank=rank, world_size=world_size, train=train, parallel=parallel, gpus=gpus)
