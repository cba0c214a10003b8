"""Micro-batches packed into one shared-memory block for the trip from a loader worker to its shard.

torch's DataLoader moves each tensor of a batch through its own shared-memory segment and file
descriptor; with ~7 tensors per micro-batch that costs the main process ~1.2 ms per batch here,
about as much as a worker needs to encode it (measured on the 2-CPU dev box). The task encoder
therefore collates a group of micro-batches straight into views of one block (`torch.
UntypedStorage._new_shared`, as torch's default collate does inside workers: no extra copy), and
the shard unpacks them into views again: one segment, one descriptor, one queue message per group.

Large tensors (the media) stay views of the block; small ones are cloned on unpacking, so a
consumer that pickles a single label tensor does not drag the whole block along.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrun.data.batch import Batch

_ALIGN = 64
_KEEP_AS_VIEW_BYTES = 64 * 1024
#: Samples per trip from a loader worker: enough to spread the per-message cost of torch's queues.
SAMPLES_PER_TRANSFER = 8


def transfer_group(micro_batch_size: int) -> int:
    """Micro-batches per trip (at least one)."""
    return max(1, SAMPLES_PER_TRANSFER // micro_batch_size)


@dataclass
class Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass
class PackedBatches:
    """Several micro-batches in one uint8 `block`; `layouts[i]` places micro-batch i's tensors."""

    block: torch.Tensor
    sample_ids: list[list[str]]
    layouts: list[list[Field]]
    #: Set by Energon's batcher: how to rebuild this group with `SavableDataLoader.restore_sample`.
    __restore_key__: tuple = ()

    def __len__(self) -> int:
        return len(self.layouts)


def allocate(layouts: list[dict[str, tuple[tuple[int, ...], torch.dtype]]], *, shared: bool
             ) -> tuple[torch.Tensor, list[list[Field]], list[dict[str, torch.Tensor]]]:
    """One block for all `layouts` (name -> (shape, dtype)); returns it, the fields, and the views.

    `shared=True` puts the block in shared memory (inside a DataLoader worker, where it will be sent).
    """
    fields, offset = [], 0
    for layout in layouts:
        placed = []
        for name, (shape, dtype) in layout.items():
            placed.append(Field(name=name, dtype=str(dtype).removeprefix("torch."), shape=tuple(shape), offset=offset))
            offset += _aligned(_nbytes(shape, dtype))
        fields.append(placed)
    if shared:
        block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(offset, 1)))
    else:
        block = torch.empty(max(offset, 1), dtype=torch.uint8)
    return block, fields, [{f.name: _view(block, f) for f in placed} for placed in fields]


def unpack(packed: PackedBatches) -> list[Batch]:
    """The micro-batches of `packed`, in order (media as views of the block, the rest cloned)."""
    return [
        _batch(ids, {f.name: _view(packed.block, f, clone_small=True) for f in placed})
        for ids, placed in zip(packed.sample_ids, packed.layouts)
    ]


def _batch(sample_ids: list[str], tensors: dict[str, torch.Tensor]) -> Batch:
    groups: dict[str, dict[str, torch.Tensor]] = {"token_inputs": {}, "media": {}}
    for name, tensor in tensors.items():
        group, _, key = name.partition(".")
        if key:
            groups[group][key] = tensor
    return Batch(sample_ids=sample_ids, input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                 labels=tensors["labels"], media=groups["media"], token_inputs=groups["token_inputs"])


def _view(block: torch.Tensor, field: Field, *, clone_small: bool = False) -> torch.Tensor:
    dtype = getattr(torch, field.dtype)
    nbytes = _nbytes(field.shape, dtype)
    view = block[field.offset: field.offset + nbytes].view(dtype).view(field.shape)
    return view.clone() if clone_small and nbytes < _KEEP_AS_VIEW_BYTES else view


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
