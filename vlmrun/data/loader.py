"""Savable Energon loader shards: the training stream of one data-parallel replica, and validation.

1. One Energon savable loader per shard: `WorkerConfig(rank=shard, world_size=num_shards,
   num_workers=data.num_workers, seed_offset=train.seed)`. Shards are disjoint, and two shards built
   with equal arguments yield identical batches in any process (driver or Ray actor).
2. `state_dict()` is plain data (`torch.load(weights_only=True)` reads it) and carries the shard's
   identity fingerprint (`vlmrun.data.fingerprint`); `load_state_dict()` refuses another identity,
   or any state once the first batch was taken (Energon restores only before iterating).
3. The stream is infinite, in exact epochs that end at a step (`vlmrun.data.epochs`); `data.virtual_epoch_length`
   ends one every that many samples (rounded down to whole transfer groups) and starts the next.
   Energon batches `transfer_group` micro-batches at a time into one shared-memory block
   (`vlmrun.data.transport`); the shard hands them out one by one. A state saved in the middle of
   a group records the group's restore key and how many micro-batches were taken.
4. The shard's worker processes keep their freed heap memory (`vlmrun.data.malloc`): memory handed
   back to the kernel after every sample is faulted in again by the next one. The process that opens
   the shard (a rank) keeps its own allocator policy.
5. Corrupt samples are skipped and counted per shard up to `data.error_tolerance`
   (`vlmrun.data.error_budget`); one more fails the shard with its key and tar file. A sample that
   does not fit `data.max_seq_len` is refused (`SampleRefused`) or, with `data.on_bad_sample: drop`,
   skipped within the same budget. `counts()` says how many samples the stream skipped and how many
   SFT conversations it cut in the micro-batches handed out so far; the counts are part of the
   state (with those of a group it is in the middle of), so a resumed shard counts exactly as an
   uninterrupted one, batch by batch.
6. Energon's loaders never unfreeze the heap: by default one freezes it as it starts iterating and
   unfreezes all of it when done, which undid a rank's `vlmrun.startup.freeze_heap` (num_workers 0, and
   the validation set, read in process): every later full collection walked the whole heap again.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from vlmrun.data.batch import Batch, PromptBatch, SampleCounts
from vlmrun.data.epochs import epoch_layout
from vlmrun.data.error_budget import CorruptDataError, ErrorBudget, SampleRefused
from vlmrun.data.fingerprint import LOADER_FORMAT, LOADER_FORMATS, LoaderStateRefused, continues, loader_fingerprint
from vlmrun.data.splits import split_size
from vlmrun.data.transport import SlotPool, transfer_group
from vlmrun.errors import InputError

logger = logging.getLogger(__name__)


def load_processor(processor_dir: str, family: str):
    """`AutoProcessor` of a local model directory, checked against the family's processor class."""
    from transformers import AutoProcessor

    from vlmrun.config.families import family_spec

    spec = family_spec(family)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers fork after it is loaded
    processor = AutoProcessor.from_pretrained(processor_dir)
    if type(processor).__name__ != spec.processor_class:
        raise InputError(
            "model.family",
            family,
            f"{processor_dir} holds a {type(processor).__name__}, but family {family!r} needs a {spec.processor_class}",
        )
    return processor


@dataclass
class _HeldGroup:
    """A group of micro-batches taken from Energon and not yet all handed out, with the counts each
    adds to the shard's when it is (`SampleCounts`: the first carries the group's drops)."""

    key: tuple
    size: int
    batches: collections.deque
    counts: collections.deque


class LoaderShard:
    """Shard `shard` of `num_shards` of the training stream; build it with `open_loader_shard`.

    Not thread-safe; use it from the process that built it (its workers are forked from there on
    the first batch). `close()` stops the worker processes; a closed shard cannot be reopened.
    Raises `InputError` at construction for a recipe whose data components, family, dataset or
    split do not fit.
    """

    def __init__(
        self,
        recipe,
        *,
        processor_dir: str,
        shard: int,
        num_shards: int,
        placement_hash: str,
        split: str,
        loader_format: int = LOADER_FORMAT,
    ):
        from megatron.energon import SavableDataLoader, WorkerConfig, get_train_dataset

        from vlmrun.data.components import check_components
        from vlmrun.data.task_encoder import task_encoder_of

        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} does not exist: there are {num_shards} shards")
        check_components(recipe)
        d, t = recipe.data, recipe.train
        self.shard, self.num_shards, self.split = shard, num_shards, split
        self.micro_batch_size = t.micro_batch_size
        if loader_format not in LOADER_FORMATS:
            raise ValueError(f"loader format {loader_format}: this vlmrun reads {LOADER_FORMATS}")
        size = split_size(d.path, split)  # InputError: no such split
        self.loader_format = loader_format
        self.epochs = epoch_layout(recipe, size, shards=num_shards) if loader_format >= 2 else None
        processor = load_processor(processor_dir, recipe.family)
        self.fingerprint = loader_fingerprint(
            recipe,
            processor_dir=processor_dir,
            chat_template=processor.chat_template,
            shard=shard,
            num_shards=num_shards,
            placement_hash=placement_hash,
            split=split,
            loader_format=loader_format,
        )
        self._budget = ErrorBudget(
            shard=shard, num_shards=num_shards, split=split, tolerance=d.error_tolerance, on_bad_sample=d.on_bad_sample
        )
        worker_config = WorkerConfig(
            rank=shard,
            world_size=num_shards,
            num_workers=d.num_workers,
            seed_offset=t.seed,
            global_error_handler=self._budget,
        )
        task_encoder = task_encoder_of(recipe, processor)
        self._pool = task_encoder.slot_pool = SlotPool(num_workers=d.num_workers)
        task_encoder.budget = self._budget
        task_encoder.epoch_samples = self.epochs.worker_samples if self.epochs is not None else None
        group_samples = t.micro_batch_size * transfer_group(t.micro_batch_size, d.transfer_samples)
        epoch_groups = max(1, d.virtual_epoch_length // group_samples) if d.virtual_epoch_length else 0
        dataset = get_train_dataset(
            d.path,
            split_part=split,
            worker_config=worker_config,
            batch_size=group_samples,
            shuffle_buffer_size=d.shuffle_buffer if d.shuffle_buffer > 1 else None,
            max_samples_per_sequence=d.max_samples_per_sequence,
            virtual_epoch_length=epoch_groups,
            task_encoder=task_encoder,
        )
        # Workers keep an internal checkpoint at least every 15 s (a restore replays at most that
        # much); Energon's forced gc.collect() runs every 50 transfer groups, not every 10 (~3% CPU),
        # without its freeze (item 6), which `get_savable_loader` cannot turn off.
        self._loader = SavableDataLoader(
            dataset, checkpoint_every_sec=15, gc_collect_every_n_steps=50, gc_freeze_at_start=False
        )
        self._iter = None
        self._held: collections.deque[_HeldGroup] = collections.deque()
        self._to_rebuild: list[dict] = []
        self._batches = 0
        self._counts = SampleCounts()
        self._closed = False
        self._num_workers, self._restart_data = d.num_workers, recipe.checkpoint.restart_data_order
        self._started_from: list | None = None  # the loaded state's worker checkpoints (None: not loaded)
        self._handed_out: set[int] = set()  # Energon workers that gave this shard a group

    def next_batch(self) -> Batch:
        """The next micro-batch (`train.micro_batch_size` samples); epochs follow each other forever.

        Raises `CorruptDataError` once the shard skipped more than `data.error_tolerance` samples, and
        `SampleRefused` for a sample that does not fit `data.max_seq_len` under `on_bad_sample: refuse`.
        """
        if self._closed:
            raise RuntimeError(f"loader shard {self.shard} is closed")
        try:
            batch = self._next()
        except (CorruptDataError, SampleRefused) as e:
            raise type(e)(_last_line(str(e), type(e))) from None
        self._batches += 1
        return batch

    def counts(self) -> SampleCounts:
        """Samples skipped and conversations cut in the micro-batches handed out so far, since the run
        began (a loaded state brings its counts)."""
        return self._counts

    def _next(self) -> Batch:
        if self._to_rebuild:
            self._rebuild_held_groups()
        while self._held and not self._held[0].batches:
            self._held.popleft()
        if not self._held:
            self._held.append(self._fetch())
        group = self._held[0]
        self._counts += group.counts.popleft()
        return group.batches.popleft()

    def _fetch(self, taken: int = 0, packed=None, counts: list | None = None) -> _HeldGroup:
        """The next group from Energon, or `packed` rebuilt from a saved state with the `counts` its
        remaining micro-batches still add (a rebuild re-encodes the samples, but cannot know what was
        dropped while the group was first filled)."""
        packed = self._next_group() if packed is None else packed
        batches = self._pool.unpack(packed)[taken:]
        if counts is None:
            counts = list(packed.counts)[taken:] or [SampleCounts()] * len(batches)
        return _HeldGroup(
            key=packed.__restore_key__,
            size=len(packed),
            batches=collections.deque(batches),
            counts=collections.deque(counts),
        )

    def _rebuild_held_groups(self) -> None:
        """Rebuild the groups a loaded state was in the middle of (see `load_state_dict`).

        The next group is fetched first: that starts the worker processes, so the tar files the
        rebuild opens in this process are not inherited by them (forked workers sharing one file
        offset read garbage).
        """
        following = self._fetch()
        for entry in self._to_rebuild:
            packed = self._loader.restore_sample(entry["group_key"])
            counts = [SampleCounts(*c) for c in entry.get("counts") or [(0, 0)] * (len(packed) - int(entry["taken"]))]
            self._held.append(self._fetch(int(entry["taken"]), packed, counts))
        self._held.append(following)
        self._to_rebuild = []

    def _next_group(self):
        group = None
        if self._iter is not None:
            try:
                group = next(self._iter)
            except StopIteration:  # the end of a virtual epoch: the next one starts where it stopped
                pass
        if group is None:
            # The first group of an epoch: that is when torch warns (once per epoch) about pin_memory
            with _quiet_pin_memory():
                self._iter = iter(self._loader)
                group = next(self._iter)
        if self._num_workers:  # its restore key: ("SavableDatasetWrapper", global worker id, index, ...)
            self._handed_out.add(group.__restore_key__[1] % self._num_workers)
        return group

    def state_dict(self) -> dict:
        """Where this shard stands, with its fingerprint; plain data for `torch.save`/`torch.load`."""
        from vlmrun.data.loader_state import settle_quiet_workers, to_plain

        pending = [
            {
                "group_key": g.key,
                "taken": g.size - len(g.batches),
                "counts": [[c.dropped, c.truncated] for c in g.counts],
            }
            for g in self._held
            if g.batches
        ]
        energon = self._loader.save_state_rank()
        if self._num_workers:
            energon = settle_quiet_workers(energon, self._started_from, self._handed_out)
        return {
            "format": self.loader_format,
            "fingerprint": dict(self.fingerprint),
            "batches": self._batches,
            "corrupt_keys": self._budget.keys(),
            "dropped_samples": self._counts.dropped,
            "truncated_samples": self._counts.truncated,
            "energon": to_plain(energon),
            "pending_groups": self._to_rebuild + pending,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refused (`LoaderStateRefused`) after the first batch or on any
        identity change, before anything is restored (but see fingerprint.continues)."""
        from vlmrun.data.loader_state import from_plain

        if self._closed:
            raise RuntimeError(f"loader shard {self.shard} is closed")
        if self._iter is not None:
            raise LoaderStateRefused(
                "loader state",
                message=f"loader shard {self.shard}: a state can only be loaded before the "
                f"first batch ({self._batches} batches were already taken)",
            )
        if not isinstance(state, dict) or "fingerprint" not in state or "energon" not in state:
            raise LoaderStateRefused(
                "loader state",
                message=f"loader shard {self.shard}: not a loader state "
                f"(keys: {sorted(state) if isinstance(state, dict) else type(state).__name__})",
            )
        goes_on = continues(state["fingerprint"], self.fingerprint, shard=self.shard, restart=self._restart_data)
        self._batches = int(state.get("batches", 0))
        self._counts = SampleCounts(int(state.get("dropped_samples", 0)), int(state.get("truncated_samples", 0)))
        self._budget.reset(list(state.get("corrupt_keys") or ()))
        if not goes_on:  # another loader version's state, and checkpoint.restart_data_order: a fresh stream
            return
        energon = from_plain(state["energon"])
        if energon is not None and self._num_workers:
            self._started_from = copy.deepcopy(energon.worker_states)  # Energon's restore scales offsets in place
        self._loader.restore_state_rank(energon)
        # Energon's state sits after the groups the saved shard was in the middle of; they are
        # rebuilt from their restore keys (every stage is stateless) when iteration starts.
        self._to_rebuild = [dict(entry) for entry in state.get("pending_groups") or ()]

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._iter = None
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._loader = None


def open_loader_shard(
    recipe,
    *,
    processor_dir: str,
    shard: int,
    num_shards: int,
    placement_hash: str,
    split: str,
    loader_format: int = LOADER_FORMAT,
) -> LoaderShard:
    """Open loader shard `shard` of `num_shards` over `split` of `recipe.data.path`, reading the stream of
    `loader_format` (vlmrun.data.fingerprint; see LoaderShard)."""
    return LoaderShard(
        recipe,
        processor_dir=processor_dir,
        shard=shard,
        num_shards=num_shards,
        placement_hash=placement_hash,
        split=split,
        loader_format=loader_format,
    )


class ValidationSet(NamedTuple):
    """The validation batches, and how many samples of the split were skipped to fill them."""

    loss_batches: list[Batch]
    prompt_batches: list[PromptBatch]
    dropped: int = 0


def val_batches(recipe, *, processor_dir: str, samples: int, batch_size: int) -> ValidationSet:
    """The first `samples` usable samples of `recipe.data.val_split` in a fixed order, as loss and prompt batches.

    Loss batches hold full conversations with labels; prompt batches the same samples' prompts,
    left-padded, with the reference answers. Corrupt samples are skipped (up to the tolerance), and
    samples that do not fit `data.max_seq_len` follow `data.on_bad_sample` (`SampleRefused`, or
    skipped); `dropped` counts the samples skipped before the last one used, or every one skipped
    when the split ran out before `samples` were found. A GRPO run's conversations may be
    `grpo.max_new_tokens` longer than its prompts (its answers are responses).
    """
    from megatron.energon import WorkerConfig, get_val_dataset
    from megatron.energon.savable_loader import BasicDataLoader  # `get_loader`, less its gc wrapper (item 6)

    from vlmrun.data.components import check_components
    from vlmrun.data.task_encoder import task_encoder_of

    d = recipe.data
    if samples <= 0:
        return ValidationSet([], [])
    check_components(recipe)
    split_size(d.path, d.val_split, field="data.val_split")
    processor = load_processor(processor_dir, recipe.family)
    budget = ErrorBudget(
        shard=0, num_shards=1, split=d.val_split, tolerance=d.error_tolerance, on_bad_sample=d.on_bad_sample
    )
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=budget)
    task_encoder = task_encoder_of(recipe, processor, val=True)
    task_encoder.budget = budget
    dataset = get_val_dataset(
        d.path, split_part=d.val_split, worker_config=worker_config, batch_size=batch_size, task_encoder=task_encoder
    )
    pairs = []
    with _quiet_pin_memory():  # no worker processes: a refusal arrives as raised, one line
        for group in BasicDataLoader(dataset, gc_collect_every_n_steps=0):
            pairs.extend(group)
            if len(pairs) >= samples:
                break
    # the split ran out: the samples skipped after the last one used were left out too
    after_last = budget.take_skipped() if len(pairs) < samples else 0
    pairs = pairs[:samples]
    encoder = task_encoder.encoder
    chunks = [pairs[i : i + batch_size] for i in range(0, len(pairs), batch_size)]
    return ValidationSet(
        [encoder.collate([s.encoded for s in c]) for c in chunks],
        [encoder.collate_prompts([s.prompt for s in c]) for c in chunks],
        sum(s.dropped_before for s in pairs) + after_last,
    )


@contextlib.contextmanager
def _quiet_pin_memory():
    # Energon always asks for pinned memory; without a GPU torch warns (every epoch) and ignores it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator", category=UserWarning)
        yield


def _last_line(text: str, kind: type[Exception]) -> str:
    """The error message itself, without the worker traceback torch puts in front of it."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else text
    prefix = f"{kind.__module__}.{kind.__name__}: "
    return last.split(prefix, 1)[-1].removeprefix(f"{kind.__name__}: ")
