"""Energon loader state <-> a tree that `torch.load(weights_only=True)` reads.

Energon's `save_state_rank()` returns dataclasses (`SavableDataLoaderState`, checkpoints, RNG
states with numpy arrays) that the weights-only unpickler refuses. `to_plain` turns them into
dicts, lists, tuples, strings, numbers, bytes and tensors; `from_plain` rebuilds them, and only
instantiates dataclasses defined inside `megatron.energon` (a checkpoint cannot name other code).

`settle_quiet_workers` corrects what Energon 7.4 saves for a loader worker that handed out nothing
since the loader started.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Any

import numpy as np
import torch

_TYPE, _FIELDS, _ITEMS = "__type__", "fields", "items"
_ALLOWED_MODULE = "megatron.energon."


class LoaderStateError(ValueError):
    """A loader state that cannot be encoded or decoded (a bug, or a tampered checkpoint)."""


def to_plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, np.ndarray):
        return {
            _TYPE: "numpy.ndarray",
            "dtype": value.dtype.str,
            "shape": list(value.shape),
            "data": np.ascontiguousarray(value).tobytes(),
        }
    if isinstance(value, np.generic):
        return {_TYPE: "numpy.generic", "dtype": value.dtype.str, "data": value.tobytes()}
    if isinstance(value, tuple):
        return tuple(to_plain(v) for v in value)
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        kind = type(value)
        name = "dict" if kind is dict else _qualified(kind)
        return {_TYPE: name, _ITEMS: [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {_TYPE: _qualified(type(value)), _FIELDS: fields}
    raise LoaderStateError(f"cannot store a {type(value).__qualname__} in a loader state")


def from_plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    name = value.get(_TYPE)
    if name == "numpy.ndarray":
        return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if name == "numpy.generic":
        return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))[0]
    if _ITEMS in value:
        items = {from_plain(k): from_plain(v) for k, v in value[_ITEMS]}
        return items if name == "dict" else _resolve(name)(items)
    if _FIELDS in value:
        cls = _resolve(name)
        fields = {k: from_plain(v) for k, v in value[_FIELDS].items()}
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                setattr(obj, k, v)
        return obj
    raise LoaderStateError(f"unknown entry in a loader state: {sorted(value)}")


def settle_quiet_workers(saved: Any, started_from: list | None, handed_out: set[int]) -> Any:
    """`saved` (from `save_state_rank()`) with every worker not in `handed_out` put back where the
    loader started it: its checkpoint in `started_from` (the restored state's `worker_states`), or
    the initial state when the loader was not restored (`started_from` None).

    Energon 7.4 gets such a worker wrong. After a restore its "last emitted sample" counter is
    the restored checkpoint's index, which leaves out the checkpoint's offset, so a second save
    forgets the samples the first state had already skipped. Then there is a race: a worker process
    that has not reached its own restore when the save command arrives answers from its
    pre-restore checkpoint (index -1). Both ways, a run resumed again soon after a resume
    silently repeats or skips transfer groups. Measured: take 30 micro-batches, save, restore, take 1,
    save, restore: the 37th micro-batch differs from an uninterrupted stream's. A worker that handed
    out a group has restored and counts from what it emitted, so its checkpoint is right.
    """
    if saved is None:
        return None
    from megatron.energon.savable_loader import SavableDatasetCheckpoint

    for worker in range(len(saved.worker_states)):
        if worker not in handed_out:
            start = started_from[worker] if started_from is not None else None
            saved.worker_states[worker] = (
                copy.deepcopy(start) if start is not None else SavableDatasetCheckpoint(state=None, offset=0)
            )
    return saved


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not (module + ".").startswith(_ALLOWED_MODULE) or not qualname:
        raise LoaderStateError(f"a loader state may only hold Energon types, not {name!r}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
