"""Identity fingerprint of a loader shard: everything that would silently change its sample stream.

A saved loader state carries the fingerprint of the shard that wrote it; restoring it into a shard
with another fingerprint is refused before anything is read, with every changed field listed as
`path: old -> new`. Field names are recipe paths where the value comes from the recipe.

`data.on_bad_sample` is not in it: it decides whether a sample that does not fit fails the run or is
skipped, and under `refuse` every sample before a checkpoint fitted, so a refused run resumed with
`drop` continues into exactly the stream a `drop` run would have had.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from vlmrun.data.epochs import epoch_layout
from vlmrun.data.splits import split_shards, split_size
from vlmrun.errors import InputError

log = logging.getLogger(__name__)

#: Bump when the loader's state layout or sample order changes for the same settings. A run keeps the
#: format it began with (its checkpoints record it: a resumed run continues its own stream, bit for bit);
#: a new run, or a resume that starts the data order over, takes the current one.
#:   1: Energon's own training pipeline (its shuffle buffer mixes an epoch's tail with the next one's head)
#:   2: exact epochs (vlmrun.data.epochs): every usable sample once per epoch, epochs that end at a step
LOADER_FORMAT = 2
LOADER_FORMATS = (1, 2)

# Files of a HF model directory that decide what the processor makes of a sample.
_PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


class LoaderStateRefused(InputError):
    """A saved loader state that this shard must not load: another identity, or too late."""


def loader_fingerprint(
    recipe,
    *,
    processor_dir: str,
    chat_template: str | None,
    shard: int,
    num_shards: int,
    placement_hash: str,
    split: str,
    loader_format: int = LOADER_FORMAT,
) -> dict[str, object]:
    """The fingerprint of one loader shard of `loader_format`, a flat dict of JSON values keyed by dotted
    path (format 1's without the epoch layout, which that format has none of)."""
    import megatron.energon

    from vlmrun.data.components import COOKERS, TASK_ENCODERS
    from vlmrun.data.transport import transfer_group

    d, t = recipe.data, recipe.train
    epoch = {}
    if loader_format >= 2:  # each loader worker's epoch, fillers included (vlmrun.data.epochs)
        epoch["loader.epoch_samples"] = epoch_layout(
            recipe, split_size(d.path, split), shards=num_shards
        ).worker_samples
    return {
        "data.path": str(Path(d.path).resolve()),
        "data.split": split,
        "data.content": dataset_content_hash(d.path, split),
        "data.num_workers": d.num_workers,
        "data.shuffle": d.shuffle_buffer > 1,
        "data.shuffle_buffer": d.shuffle_buffer,
        "data.max_samples_per_sequence": d.max_samples_per_sequence,
        "data.virtual_epoch_length": d.virtual_epoch_length,
        "data.max_seq_len": d.max_seq_len,
        "data.family": recipe.family,
        "data.cookers": [COOKERS[name].tag for name in d.cookers],
        "data.task_encoder": TASK_ENCODERS[d.task_encoder].tag,
        "train.seed": t.seed,
        "train.micro_batch_size": t.micro_batch_size,
        "loader.transfer_group": transfer_group(t.micro_batch_size, d.transfer_samples),
        **epoch,
        "processor.config": processor_config_hash(processor_dir),
        "processor.chat_template": _sha(chat_template or ""),
        "versions.energon": megatron.energon.__version__,
        "versions.loader_format": loader_format,
        "topology.shard": shard,
        "topology.num_shards": num_shards,
        "topology.placement_hash": placement_hash,
    }


def check_same_identity(saved: dict[str, object], current: dict[str, object], *, shard: int) -> None:
    """Raise `LoaderStateRefused` listing every field where `saved` and `current` differ."""
    changes = [
        f"{key}: {_show(saved.get(key, '<missing>'))} -> {_show(current.get(key, '<missing>'))}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, "<missing>") != current.get(key, "<missing>")
    ]
    if changes:
        fields = ", ".join(c.split(":", 1)[0] for c in changes)
        advice = "Resume with the settings it was saved with."
        if other_software(saved, current):
            advice = (
                "Another version of the loader (vlmrun's loader format, or Energon) wrote it, and this one cannot "
                "continue its stream: finish the run with the version that wrote it, or `vlmrun resume "
                "--restart-data-order` to keep the model, optimizer state and counters and start the data order over."
            )
        raise LoaderStateRefused(
            fields,
            message=f"loader shard {shard}: the saved loader state belongs to another data stream; "
            f"changed: {'; '.join(changes)}. {advice}",
        )


def other_software(saved: dict[str, object], current: dict[str, object]) -> bool:
    """Whether another loader format or Energon version wrote the fingerprint `saved`."""
    return any(saved.get(k) != current.get(k) for k in current if k.startswith("versions."))


def continues(saved: dict[str, object], current: dict[str, object], *, shard: int, restart: bool) -> bool:
    """True when a state of fingerprint `saved` continues in the shard of fingerprint `current`; False
    when another loader version wrote it and `restart` (checkpoint.restart_data_order) starts the data
    order over; else `check_same_identity` refuses it."""
    if restart and other_software(saved, current):
        log.warning("loader shard %d: another loader version wrote its state: the data order starts over", shard)
        return False
    check_same_identity(saved, current, shard=shard)
    return True


def dataset_content_hash(path: str | Path, split: str) -> str:
    """Hash of the split's shard names and sample counts (from `.nv-meta`), not of the bytes."""
    return _sha(json.dumps(split_shards(path, split), sort_keys=True))


def processor_config_hash(processor_dir: str | Path) -> str:
    """Hash of the processor's and tokenizer's files in a HF model directory."""
    digest = hashlib.sha256()
    for name in _PROCESSOR_FILES:
        file = Path(processor_dir) / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _show(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 120 else text[:117] + "..."
