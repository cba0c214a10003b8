"""What defines a run: the recipe fields a resume may not change, because its checkpoints belong to them.

A checkpoint records `run_identity(recipe, model_contents=...)`; `vlmrun resume` (before anything
starts) and the job (at its start, from the checkpoint it verified) compare it with the recipe about
to run, whatever changed it (`--set`, or an edited recipe.yaml), and refuse a change naming every
field as `field: old -> new`.

The recipe names the model by its path; what the path holds is part of the run too (other weights at
the same path would change the training, and GRPO's KL reference: the model directory's initial
weights). The caller passes a fingerprint of it (models/fingerprint.py; None for a tiny model, which
`model.tiny`, `model.family` and `train.seed` already define), recorded as MODEL_CONTENTS.
"""

from __future__ import annotations

import logging
from typing import Any

from vlmrun.errors import InputError

log = logging.getLogger(__name__)

#: Dotted recipe fields: batch sizes, layout, seed, data and its splits, sequence length, loop,
#: algorithm, GRPO's group size, the generation engine (its sampling stream is in the checkpoint) and model (its LoRA
#: adapters' settings included: a checkpoint holds the adapters of those settings only).
IDENTITY_FIELDS = (
    "train.algorithm",
    "train.loop",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.seed",
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "parallel.cp",
    "parallel.fsdp",
    "parallel.dp_shard",
    "data.path",
    "data.split",
    "data.val_split",
    "data.max_seq_len",
    "grpo.num_generations",
    "generation.backend",
    "model.family",
    "model.path",
    "model.tiny",
    "model.backend",
    "model.dtype",
    "model.lora",
)
#: The identity key of the fingerprint of what model.path holds.
MODEL_CONTENTS = "model.path contents"
#: Identity fields a resume may change with `--restart-data-order` (checkpoint.restart_data_order),
#: and what that costs, in the words every message about it uses.
RESHARDABLE = ("parallel.dp",)
#: Identity fields a resume may change while the data order carries on: how each data-parallel replica
#: is cut over ranks (model.backend megatron, whose checkpoints read into any tp x pp); the loader
#: shards, their positions and each replica's streams are per replica, and stay.
RELAYOUTABLE = ("parallel.tp", "parallel.pp")
RELAYOUT_TERMS = (
    "the model and optimizer state are read into the new tp x pp; the data order, the counters and each "
    "replica's streams carry on (same parallel.dp)"
)
RESHARD_TERMS = (
    "keep the model, optimizer state, LR schedule and step counters (resharded to the new layout) and lose "
    "every loader shard's position and every rank's RNG stream: the data order starts over"
)


def run_identity(recipe, *, model_contents: str | None) -> dict[str, Any]:
    """{dotted field: value} of IDENTITY_FIELDS for `recipe` (JSON values), and `model_contents` (the
    fingerprint of what model.path holds; None for a tiny model) as MODEL_CONTENTS."""
    out = {}
    for dotted in IDENTITY_FIELDS:
        value: Any = recipe
        for part in dotted.split("."):
            value = getattr(value, part)
        out[dotted] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    if model_contents is not None:
        out[MODEL_CONTENTS] = model_contents
    return out


def check_same_identity(
    saved: dict[str, Any], current: dict[str, Any], *, where: str, ignore: tuple[str, ...] = ()
) -> None:
    """Raise InputError listing every field where the `current` identity (run_identity of the recipe
    about to run) differs from the `saved` one.

    `where` names the checkpoint for the message. Fields `saved` lacks (written by an older vlmrun)
    and fields in `ignore` are not compared.
    """
    keys = [k for k in (*IDENTITY_FIELDS, MODEL_CONTENTS) if k in saved and k not in ignore]
    changes = [(k, saved[k], current.get(k)) for k in keys if saved[k] != current.get(k)]
    if not changes:
        return
    listed = "; ".join(f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in changes)
    field = changes[0][0] if changes[0][0] != MODEL_CONTENTS else "model.path"
    raise InputError(
        field,
        changes[0][2],
        message=f"{listed}: {where} belongs to the old value{'s' if len(changes) > 1 else ''}; "
        "a resume continues the same run (put the old values back), or start a new run with `vlmrun submit`",
    )


def restarts_data_order(saved, identity: dict[str, Any], plan, restart: bool, path) -> bool:
    """Whether the run takes the checkpoint at `path` with its data order started over: True when only
    the layout differs (another dp, tp or pp) and `restart` (checkpoint.restart_data_order) lets the run take its
    model, optimizer and counters; False at the same layout, or another tp or pp at the same dp without
    `restart` (RELAYOUTABLE: the data order carries on). Refuses it (InputError, exit 2) when another run definition, or
    another layout without `restart`, wrote it. `saved` is what its manifest says of the run that wrote
    it (`identity`, `placement_hash`, `layout`); `plan` is this run's placement (`placement_hash`,
    `describe()`)."""
    ignore = RESHARDABLE + RELAYOUTABLE if restart else RELAYOUTABLE
    check_same_identity(saved.identity, identity, where=f"checkpoint {path}", ignore=ignore)
    if saved.placement_hash == plan.placement_hash:
        return False
    if not restart and saved.identity.get("parallel.dp") == identity.get("parallel.dp"):
        log.info("%s: from %s to %s: %s", path, saved.layout, plan.describe(), RELAYOUT_TERMS)
        return False
    if not restart:
        raise InputError(
            "parallel",
            plan.describe(),
            f"checkpoint {path} was written with layout {saved.layout} "
            f"(placement {saved.placement_hash}), this run has {plan.describe()} "
            f"(placement {plan.placement_hash}); resume with the same layout, or "
            f"`vlmrun resume --restart-data-order` to {RESHARD_TERMS}",
        )
    log.warning("%s: %s", path, RESHARD_TERMS)
    return True


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
