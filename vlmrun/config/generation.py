"""Config of generation: which engine samples responses (GRPO's rollouts) and validation's greedy answers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.section import Section


class GenerationConfig(Section):
    """`backend` names the generation engine (`vlmrun.generation.open_generator`): `hf` is transformers'
    `generate` in the rank's own process, refit from the policy in memory."""

    backend: Literal["hf"] = Field("hf", description="the generation engine: hf (transformers generate)")
