"""Config of generation: which engine samples responses (GRPO's rollouts) and validation's greedy answers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.section import Section


class GenerationConfig(Section):
    """`backend` names the generation engine (`vlmrun.generation.open_generator`): `hf` is transformers'
    `generate` in the rank's own process, refit from the policy in memory, one bucket of weights at a
    time (`refit_bucket_mb`; not part of the run identity: the bucket size changes no number)."""

    backend: Literal["hf"] = Field("hf", description="the generation engine: hf (transformers generate)")
    release_weights: bool = Field(
        False,
        description="free the engine's weights after each rollout and validation pass (the next refit "
        "allocates them again): the training phases then run without the engine's copy of the model beside "
        "them, what a big model on one GPU needs (the memory check counts either way)",
    )
    refit_bucket_mb: int = Field(
        256,
        ge=1,
        le=1 << 16,
        description="refit streams the policy's weights into the engine in buckets of at most this many MB "
        "(a larger tensor goes alone): the memory a refit takes beyond the engine's own weights",
    )
