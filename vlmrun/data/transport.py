"""Micro-batches packed into reusable shared-memory blocks for the trip from a loader worker.

1. torch's DataLoader moves every tensor of a batch through its own new shared-memory segment and
   file descriptor. A new segment is paid for in page faults in the worker, and again in the main
   process when it reads the pages: for image batches, more CPU than encoding the samples.
2. So the task encoder collates a group of `transfer_group` micro-batches straight into views of
   one block, and the block comes from a `SlotPool`: a few blocks per worker, allocated once and
   reused. The main process copies each micro-batch out into its own private memory and hands the
   slot back; it keeps a reference to each slot's block, so torch maps it only once
   (docs/measurements.md has the CPU per trip either way).
3. A slot is reused only after the main process released it (flags in a `multiprocessing.Array`
   created before the workers fork; its lock orders the copy before the release). When no slot is
   free the worker takes a fresh block, so a slow consumer costs speed, never correctness.

Every micro-batch ends up in memory of its own (Ray pickles a view with its whole storage);
within it, large tensors (the media) are views, small ones are cloned.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field

import torch

from vlmrun.data.batch import Batch, PromptBatch, SampleCounts

_ALIGN = 64
_KEEP_AS_VIEW_BYTES = 64 * 1024
_SLOTS_PER_WORKER = 4  # torch's prefetch (2 per worker) + one being filled + one in the main process
_GROWTH = 1.25
#: Default samples per trip from a loader worker (`data.transfer_samples`): enough to spread the
#: per-trip cost of torch's queues and of Energon's per-batch stages.
SAMPLES_PER_TRANSFER = 8


def transfer_group(micro_batch_size: int, samples: int = SAMPLES_PER_TRANSFER) -> int:
    """Micro-batches per trip: `samples` rounded down to whole micro-batches, at least one."""
    return max(1, samples // micro_batch_size)


@dataclass
class Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass
class Part:
    """One micro-batch inside `PackedBatches.blocks[block]`, bytes [start, end); field offsets from start."""

    sample_ids: list[str]
    fields: list[Field]
    block: int
    start: int
    end: int


@dataclass
class PackedBatches:
    """Several micro-batches in uint8 blocks: one shared block for a trip from a worker, or one
    private block per micro-batch when built in the receiving process.

    `slot` is the `SlotPool` slot of a pooled block (None otherwise).
    """

    blocks: list[torch.Tensor]
    parts: list[Part]
    slot: int | None = None
    #: Set by Energon's batcher: how to rebuild this group with `SavableDataLoader.restore_sample`.
    __restore_key__: tuple = ()
    #: Per micro-batch, what it adds to its shard's `SampleCounts` (set by the task encoder's batcher).
    counts: list[SampleCounts] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.parts)


@dataclass
class PromptGroup:
    """Prompt micro-batches (GRPO's task encoder) as they travel from a loader worker: pickled by torch
    as they are (prompts are a few hundred tokens and their images; no slot pool)."""

    batches: list[PromptBatch]
    __restore_key__: tuple = ()
    counts: list[SampleCounts] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass
class SlotPool:
    """Reusable shared-memory blocks for the workers of one loader (see module doc).

    Create it in the main process before the workers fork. Workers call `block`, the main process
    `unpack`; both work unchanged without workers.
    """

    num_workers: int
    _busy: object = field(init=False, repr=False)
    _own: dict = field(default_factory=dict, repr=False)  # in a worker: slot -> its block
    _mapped: dict = field(default_factory=dict, repr=False)  # in the main process: slot -> received block
    _turn: int = 0

    def __post_init__(self):
        self._busy = multiprocessing.get_context("fork").Array("b", max(1, self.num_workers) * _SLOTS_PER_WORKER)

    def block(self, nbytes: int) -> tuple[torch.Tensor, int | None]:
        """Inside a worker: a shared block of at least `nbytes` to fill and send, and its slot
        (None: a fresh block, because every slot of this worker is still in use)."""
        info = torch.utils.data.get_worker_info()
        for i in range(_SLOTS_PER_WORKER):
            slot = info.id * _SLOTS_PER_WORKER + (self._turn + i) % _SLOTS_PER_WORKER
            with self._busy.get_lock():
                if self._busy[slot]:
                    continue
                self._busy[slot] = 1
            self._turn += i + 1
            block = self._own.get(slot)
            if block is None or block.numel() < nbytes:
                block = self._own[slot] = _shared(int(nbytes * _GROWTH))
            return block, slot
        return _shared(nbytes), None

    def unpack(self, packed: PackedBatches | PromptGroup) -> list[Batch] | list[PromptBatch]:
        """In the main process: the micro-batches, each in its own private memory; the slot is free again."""
        if isinstance(packed, PromptGroup):
            return list(packed.batches)
        batches = unpack(packed)
        if packed.slot is not None:
            self._mapped[packed.slot] = packed.blocks[0]  # keeps torch's mapping of the slot alive for reuse
            with self._busy.get_lock():
                self._busy[packed.slot] = 0
        return batches


def collate_packed(encoder, groups: list[list], pool: SlotPool | None = None) -> PackedBatches:
    """Collate each list of encoded samples into one micro-batch.

    `encoder` is a `ConversationEncoder` (its `batch_layout` and `collate`). Inside a DataLoader
    worker all micro-batches go into one shared block (from `pool` when given); elsewhere each gets
    its own private block, ready to use without a copy.
    """
    placed = [_place(encoder.batch_layout(g)) for g in groups]
    ids = [[e.key for e in g] for g in groups]
    if torch.utils.data.get_worker_info() is None:
        blocks = [torch.empty(max(n, 1), dtype=torch.uint8) for _, n in placed]
        parts = [
            Part(sample_ids=i, fields=f, block=k, start=0, end=n)
            for k, (i, (f, n)) in enumerate(zip(ids, placed, strict=True))
        ]
        slot = None
    else:
        parts, offset = [], 0
        for i, (f, n) in zip(ids, placed, strict=True):
            parts.append(Part(sample_ids=i, fields=f, block=0, start=offset, end=offset + n))
            offset += _aligned(n)
        block, slot = pool.block(offset) if pool is not None else (_shared(offset), None)
        blocks = [block]
    for group, part in zip(groups, parts, strict=True):
        base = blocks[part.block][part.start : part.end]
        encoder.collate(group, out={f.name: _view(base, f) for f in part.fields})
    return PackedBatches(blocks=blocks, parts=parts, slot=slot)


def unpack(packed: PackedBatches) -> list[Batch]:
    """The micro-batches of `packed`, in order. Each gets its own memory: a part of a shared block
    is copied out (the block goes back to its worker, and a consumer that pickles one micro-batch,
    e.g. Ray, must not drag the others along); small tensors are cloned, media stay views."""
    batches = []
    for part in packed.parts:
        base = packed.blocks[part.block][part.start : part.end]
        if base.is_shared() or part.start or part.end != packed.blocks[part.block].numel():
            base = base.clone()
        batches.append(_batch(part.sample_ids, {f.name: _view(base, f, clone_small=True) for f in part.fields}))
    return batches


def _place(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Field], int]:
    """Fields of one micro-batch laid out from offset 0, and the bytes they take."""
    fields, offset = [], 0
    for name, (shape, dtype) in layout.items():
        fields.append(Field(name=name, dtype=str(dtype).removeprefix("torch."), shape=tuple(shape), offset=offset))
        offset += _aligned(_nbytes(shape, dtype))
    return fields, offset


def _shared(nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)))


def _batch(sample_ids: list[str], tensors: dict[str, torch.Tensor]) -> Batch:
    groups: dict[str, dict[str, torch.Tensor]] = {"token_inputs": {}, "media": {}}
    for name, tensor in tensors.items():
        group, _, key = name.partition(".")
        if key:
            groups[group][key] = tensor
    return Batch(
        sample_ids=sample_ids,
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        labels=tensors["labels"],
        media=groups["media"],
        token_inputs=groups["token_inputs"],
    )


def _view(block: torch.Tensor, field: Field, *, clone_small: bool = False) -> torch.Tensor:
    dtype = getattr(torch, field.dtype)
    nbytes = _nbytes(field.shape, dtype)
    view = block[field.offset : field.offset + nbytes].view(dtype).view(field.shape)
    return view.clone() if clone_small and nbytes < _KEEP_AS_VIEW_BYTES else view


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
