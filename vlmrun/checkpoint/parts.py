"""The parts of a checkpoint and the file each goes to: the one place a checkpoint's paths are spelled.

    policy/model.pt, policy/optimizer.pt   the policy's parts, one copy for every rank (`Storage.REPLICATED`)
    policy/sharded/                        or every rank its shard through torch.distributed.checkpoint
                                           (`Storage.SHARDED`): `__<rank>_<i>.distcp` files and `.metadata`
    controller.json                        the controller's RNG and step counters
    rng/rank_<k>.pt                        every rank's RNG
    loader/shard_<r>.pt                    every loader shard's Energon state, with its identity fingerprint
    plane/shard_<r>.pt                     the data plane's state of replica r, where it is not empty
    generation/replica_<r>.pt              GRPO: replica r's sampling stream

A component writes its state as a named part (`PendingCheckpoint.write(part, state, index)`) and reads it
back by the same name; only this module knows the file. The layouts of older formats are in legacy.py.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

#: The parts a policy owns: its weights by parameter name, and its optimizer with the LR schedule.
MODEL_PART, OPTIMIZER_PART = "model", "optimizer"
POLICY_PARTS = (MODEL_PART, OPTIMIZER_PART)

#: Part -> file, relative to the checkpoint folder; `{index}` is the rank, the loader shard or the replica.
PARTS = {
    "controller": "controller.json",
    **{part: f"policy/{part}.pt" for part in POLICY_PARTS},
    "rng": "rng/rank_{index}.pt",
    "loader": "loader/shard_{index}.pt",
    "plane": "plane/shard_{index}.pt",
    "generation": "generation/replica_{index}.pt",
}
#: The folder of a sharded policy's parts, and the file DCP writes last (rank 0's metadata).
SHARDED_POLICY = "policy/sharded"
DCP_METADATA = ".metadata"
SHARDED_METADATA = f"{SHARDED_POLICY}/{DCP_METADATA}"
#: Parts without which no checkpoint can be resumed, beside the policy's (every part of POLICY_PARTS
#: as one copy, or the sharded policy's metadata).
REQUIRED = ("controller",)


class Storage(enum.Enum):
    """How a policy's checkpoint state is held across ranks, and so how it is written and read."""

    REPLICATED = "replicated"  # every rank holds the same state: rank 0 writes it for all, every rank reads it
    SHARDED = "sharded"  # each rank holds its shard: every rank writes and reads its own, together (collective)


@dataclass(frozen=True)
class PolicyState:
    """A policy's share of a checkpoint: `parts` by name (POLICY_PARTS, or some of them), each a state
    of tensors (DTensors when sharded) and plain containers."""

    storage: Storage
    parts: dict[str, Any]

    def __post_init__(self):
        unknown = set(self.parts) - set(POLICY_PARTS)
        if unknown:
            raise ValueError(f"policy state parts {sorted(unknown)} are not policy parts ({', '.join(POLICY_PARTS)})")


def part_file(part: str, index: int | None = None, *, layout: dict[str, str] = PARTS) -> str:
    """The file of `part` (of the rank, shard or replica `index` where the part has one) in `layout`."""
    if part not in layout:
        raise ValueError(f"unknown checkpoint part {part!r}; parts are {', '.join(layout)}")
    pattern = layout[part]
    if ("{index}" in pattern) != (index is not None):
        raise ValueError(f"checkpoint part {part!r} {'needs' if index is None else 'takes no'} index")
    return pattern.format(index=index)


def lacking_parts(files: Container[str], layout: dict[str, str] = PARTS) -> list[str]:
    """The required parts `files` lacks: the controller's, and the policy's (one copy or sharded)."""
    lacking = [p for p in REQUIRED if part_file(p, layout=layout) not in files]
    if SHARDED_METADATA not in files:
        lacking += [p for p in POLICY_PARTS if part_file(p, layout=layout) not in files]
    return lacking
