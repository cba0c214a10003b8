"""Refit: a generation engine takes the policy's current weights, before it generates from them.

The policy streams its weights in buckets of whole tensors (`PolicyBackend.weights_for_refit`), cast
to the engine's dtype, and the engine copies each bucket into its own tensors before the next is
drawn (`GenerationBackend.load_weights`): beyond the engine's weights, a refit holds one bucket
(`generation.refit_bucket_mb`), never a second whole model, and on a GPU nothing goes through the host.
Collective when the policy is sharded, or tensor or pipeline parallel: every rank refits together; a
rank of a replica whose engine lives on another rank (its owner) draws the buckets with no engine.
"""

from __future__ import annotations

from vlmrun.generation.interface import GenerationBackend
from vlmrun.policy.interface import REFIT_BUCKET_BYTES, PolicyBackend


def refit(engine: GenerationBackend | None, policy: PolicyBackend, *, bucket_bytes: int = REFIT_BUCKET_BYTES) -> None:
    """Fill `engine`'s weights from `policy`'s, `bucket_bytes` at a time; straight into the engine's own
    tensors where it offers them (`refit_targets`). Without `engine`, this rank's part of the refit's
    collectives (its buckets are drawn and dropped). Nothing for an engine that reads the policy's weights."""
    if engine is None:
        for _ in policy.weights_for_refit(bucket_bytes=bucket_bytes):
            pass
        return
    if getattr(engine, "reads_policy_weights", False):
        return
    targets = engine.refit_targets()
    into = {} if targets is None else {"into": targets}
    engine.load_weights(policy.weights_for_refit(dtype=engine.weights_dtype, bucket_bytes=bucket_bytes, **into))
