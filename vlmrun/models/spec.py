"""What a backend builds its model from: a model directory, or an architecture config for random init.

`ModelSpec` is what the policy and generation factories take (`vlmrun.policy.open_policy`,
`vlmrun.generation.open_generator`), so the training path and the checks and benchmarks that build
large random-init models run the same backend code. Standard library only: it travels to Ray actors
and to the GPU checks, which have no pydantic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlmrun.config.dtype import DTYPES


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Exactly one of `directory` (a local Hugging Face model directory: its weights are loaded) or
    `config` (the content of a config.json: the architecture, random-init from `seed`; the backend
    builds it on the meta device and materializes only its own shards where it shards the model).
    `dtype` is the weights' dtype (a `model.dtype` name), `attn_implementation` transformers' attention
    kernel (`model.attn_implementation`). `lora`: the policy trains LoRA adapters of these settings on
    the frozen model (`model.lora` as a plain dict: rank, alpha, dropout, targets, vision, projector,
    init; policy/lora.py); None: every weight trains. Generation engines ignore it (they take merged weights)."""

    directory: str | None = None
    config: Mapping[str, Any] | None = None
    seed: int = 0
    dtype: str = "float32"
    attn_implementation: str = "sdpa"  # transformers' name: sdpa, eager, flash_attention_2
    lora: Mapping[str, Any] | None = None

    def __post_init__(self):
        if (self.directory is None) == (self.config is None):
            raise ValueError("a ModelSpec names exactly one of directory (a model directory) or config (random init)")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("ModelSpec.config is a config.json's content, which names its model_type")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelSpec.dtype {self.dtype!r}: allowed {', '.join(DTYPES)}")

    @property
    def random_init(self) -> bool:
        return self.config is not None

    def describe(self) -> str:
        """One line for logs and errors: the directory, or the architecture and seed."""
        if self.directory is not None:
            return self.directory
        return f"random-init {self.config['model_type']} (seed {self.seed})"
