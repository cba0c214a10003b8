"""The policy's share of a checkpoint, written and read the same way by every algorithm's workers.

A replicated policy (every rank holds the same state) is written once, by rank 0, as the `model` and
`optimizer` parts; a sharded one (FSDP2) by every rank at once, as the `policy` sharded part (DCP).
"""

from __future__ import annotations

from vlmrun.algorithms.common.checkpoint import Checkpoint, PendingCheckpoint
from vlmrun.errors import InputError
from vlmrun.policy.interface import CHECKPOINT_PARTS, PolicyBackend


def save_policy(policy: PolicyBackend, pending: PendingCheckpoint, *, rank: int) -> dict[str, dict]:
    """Write this rank's share of the policy; returns {file: digest}. Collective when sharded."""
    if policy.sharded_state:
        return pending.write_sharded("policy", policy.state_dict(), rank=rank)
    files: dict[str, dict] = {}
    if rank == 0:
        for part, state in policy.state_dict().items():
            files |= pending.write(part, state)
    return files


def load_policy(policy: PolicyBackend, checkpoint: Checkpoint) -> None:
    """Restore the policy from `checkpoint` (a sharded one reshards to this run's dp). Collective
    when sharded. InputError when the checkpoint was written by the other kind of policy."""
    sharded = checkpoint.has_sharded("policy")
    if sharded != policy.sharded_state:
        written = "true" if sharded else "false"
        raise InputError(
            "parallel.fsdp",
            not sharded,
            message=f"parallel.fsdp: checkpoint {checkpoint.path} was written with parallel.fsdp: {written}; "
            f"resume with parallel.fsdp: {written}",
        )
    if sharded:
        state = policy.state_dict()
        checkpoint.read_sharded("policy", state)
        policy.load_state_dict(state)
    else:
        policy.load_state_dict({part: checkpoint.read(part) for part in CHECKPOINT_PARTS})
