"""Config of the policy: which model, which backend, how it is laid out across ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vlmrun.config.backends import POLICY_BACKEND_NAMES, POLICY_BACKENDS
from vlmrun.config.dtype import DTYPES
from vlmrun.config.families import Family
from vlmrun.config.lora import LoraConfig
from vlmrun.config.section import Section


class ModelConfig(Section):
    """The model to train: a local HF directory (`path`) or a tiny one built from config (`tiny`)."""

    family: Family
    path: str | None = Field(None, description="local HF model directory (weights, processor, chat template)")
    tiny: bool = Field(False, description="build a tiny random-init model of `family` under the run's cache dir")
    backend: Literal[POLICY_BACKEND_NAMES] = Field(
        "hf",
        description="the policy backend (vlmrun.policy.open_policy): "
        + "; ".join(f"{name} ({spec.about})" for name, spec in POLICY_BACKENDS.items()),
    )
    dtype: Literal[DTYPES] = "float32"  # torch dtypes: config/dtype.py
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description="transformers' attention kernel for the policy, its reference and the hf engine: sdpa "
        "(torch's), eager, or flash_attention_2 (needs GPUs, bf16 compute and the flash-attn package on "
        "the nodes: the `gpu` extra)",
    )
    lora: LoraConfig | None = Field(
        None,
        description="train LoRA adapters on the frozen model instead of every weight (config/lora.py); "
        "absent: full training",
    )
    reference_config: str | None = Field(
        None,
        pattern=r"^[a-z0-9_]+$",
        description="architecture config shipped in vlmrun/models/reference/ (name without .json) for the "
        "memory estimate when model.path has no config.json here: `--dry-run` then needs no weights on this "
        "machine (a submit does); unused with model.tiny, which estimates the tiny model it trains",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.tiny == (self.path is not None):
            raise ValueError("set exactly one of model.path (a local model directory) or model.tiny: true")
        return self
