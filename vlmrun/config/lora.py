"""Config of LoRA adapters (`model.lora`): low-rank adapters train, the base model stays frozen.

Light on purpose (no torch, no peft): the recipe validates it on a login node. Which modules each named
set reaches in each family is decided where the model is built (vlmrun/policy/lora.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.section import Section

#: The named sets of the language model's linear layers an adapter may wrap.
TARGETS = ("attention", "mlp", "all_linear")
#: How the adapters start: B is zero in both, so the first step's model is the base exactly; A is
#: peft's default (kaiming-uniform) or gaussian (std 1/rank).
INITS = ("default", "gaussian")


class LoraConfig(Section):
    """LoRA adapters on the language model's linear layers, and optionally on the vision tower and the
    projector; only the adapters train and only they go into checkpoints (the base is referenced). Any
    field of the section turns it on (`--set model.lora.rank=8`); the others keep their defaults."""

    rank: int = Field(16, ge=1, le=4096, description="the adapters' rank r (A is r x in, B is out x r)")
    alpha: float = Field(16.0, gt=0, description="scale alpha: an adapter adds (alpha / rank) x B @ A to its weight")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input while training")
    targets: Literal[TARGETS] = Field(
        "all_linear",
        description="the language model's linear layers that get adapters: attention (q, k, v, o projections), "
        "mlp (gate, up, down projections) or all_linear (every linear layer of its decoder layers; "
        "the LM head never)",
    )
    vision: bool = Field(False, description="adapters on every linear layer of the vision tower's blocks too")
    projector: bool = Field(False, description="adapters on the projector (vision -> language) too")
    init: Literal[INITS] = Field(
        "default", description="the adapters' initialisation (B zero: the first step starts at the base)"
    )
