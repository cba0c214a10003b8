"""The parts of a checkpoint and the file each goes to: the one place a checkpoint's paths are spelled.

    policy/model.pt, policy/optimizer.pt   the policy's parts, one copy for every rank (`Storage.REPLICATED`)
    policy/sharded/                        or every rank its shard through torch.distributed.checkpoint
                                           (`Storage.SHARDED`): `__<rank>_<i>.distcp` files and `.metadata`
    policy/pieces/<part>_<k>.pt            or every writing rank k the pieces of the HF tensors it holds
                                           (`Storage.PIECES`: the megatron backend's tp x pp layouts)
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
    **{f"pieces_{part}": f"policy/pieces/{part}_{{index}}.pt" for part in POLICY_PARTS},
}
#: The folder of a sharded policy's parts, and the file DCP writes last (rank 0's metadata).
SHARDED_POLICY = "policy/sharded"
DCP_METADATA = ".metadata"
SHARDED_METADATA = f"{SHARDED_POLICY}/{DCP_METADATA}"
#: The folder of a policy's pieces, and the file every such checkpoint has (writer 0's model part).
PIECES_POLICY = "policy/pieces"
PIECES_FIRST = f"{PIECES_POLICY}/{MODEL_PART}_0.pt"
#: Parts without which no checkpoint can be resumed, beside the policy's (every part of POLICY_PARTS
#: as one copy, or the sharded policy's metadata).
REQUIRED = ("controller",)


class Storage(enum.Enum):
    """How a policy's checkpoint state is held across ranks, and so how it is written and read."""

    REPLICATED = "replicated"  # every rank holds the same state: rank 0 writes it for all, every rank reads it
    SHARDED = "sharded"  # each rank holds its shard: every rank writes and reads its own, together (collective)
    # each writing rank holds pieces of the named tensors and writes them to its own file per part (no
    # collective); a reader gets every writer's file of a part and takes the pieces it needs (`PieceFiles`)
    PIECES = "pieces"


@dataclass(frozen=True)
class PolicyState:
    """A policy's share of a checkpoint: `parts` by name (POLICY_PARTS, or some of them), each a state
    of tensors (DTensors when sharded) and plain containers. With `Storage.PIECES`, `writer` is this
    rank's file index, or None where another rank writes the same pieces (a data-parallel replica);
    read back, each part is a `PieceFiles`."""

    storage: Storage
    parts: dict[str, Any]
    writer: int | None = None

    def __post_init__(self):
        unknown = set(self.parts) - set(POLICY_PARTS)
        if unknown:
            raise ValueError(f"policy state parts {sorted(unknown)} are not policy parts ({', '.join(POLICY_PARTS)})")


@dataclass(frozen=True)
class PieceFiles:
    """Every writer's file of one part of a `Storage.PIECES` policy, in writer order; `load(i)` gives
    writer i's state, its tensors mapped from the file (read as they are touched)."""

    paths: tuple[str, ...]

    def load(self, i: int) -> Any:
        import torch

        return torch.load(self.paths[i], weights_only=True, mmap=True)

    def __len__(self) -> int:
        return len(self.paths)


def part_file(part: str, index: int | None = None, *, layout: dict[str, str] = PARTS) -> str:
    """The file of `part` (of the rank, shard or replica `index` where the part has one) in `layout`."""
    if part not in layout:
        raise ValueError(f"unknown checkpoint part {part!r}; parts are {', '.join(layout)}")
    pattern = layout[part]
    if ("{index}" in pattern) != (index is not None):
        raise ValueError(f"checkpoint part {part!r} {'needs' if index is None else 'takes no'} index")
    return pattern.format(index=index)


def lacking_parts(files: Container[str], layout: dict[str, str] = PARTS) -> list[str]:
    """The required parts `files` lacks: the controller's, and the policy's (one copy, sharded or pieces)."""
    lacking = [p for p in REQUIRED if part_file(p, layout=layout) not in files]
    if SHARDED_METADATA not in files and PIECES_FIRST not in files:
        lacking += [p for p in POLICY_PARTS if part_file(p, layout=layout) not in files]
    return lacking
