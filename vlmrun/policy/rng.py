"""Capture and restore every RNG a rank uses (python, numpy, torch), for bitwise-identical resumes.

numpy and torch are imported when a function runs: the rank worker's module imports this one, and the
controller imports that module for the class alone (it holds no torch: algorithms/common/loop.py).
"""

from __future__ import annotations

import random


def python_rng_state() -> list:
    """Python's RNG state as plain lists (JSON and `torch.load(weights_only=True)` both read it back)."""
    return _to_lists(random.getstate())


def set_python_rng_state(state: list) -> None:
    version, internal, gauss = state
    random.setstate((version, tuple(internal), gauss))


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """A state that `torch.load(weights_only=True)` can read back (tensors, lists, ints, strings)."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    return {
        "python": python_rng_state(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    set_python_rng_state(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])


def _to_lists(value):
    if isinstance(value, tuple):
        return [_to_lists(v) for v in value]
    return value
