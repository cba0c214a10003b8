"""The model families vlmrun supports: one registry, read by the recipe, the data path and the tiny builders.

Light on purpose (no torch, no transformers): the recipe validates `model.family` against it on a
login node. A `FamilySpec` names the processor class a model directory must carry and the
`model_type` its config.json says (checked at submit: models/source.py), and sorts the processor's
outputs: per-token inputs (padded with the batch, e.g. Qwen's `mm_token_type_ids`, without which
Qwen2.5-VL silently falls back to 1-D positions and Qwen2-VL and Qwen3-VL refuse images) and packed
media (rows of all images concatenated, plus their grid sizes). Its `capabilities` say what vlmrun
runs the family's models with beyond what every family has (SFT, GRPO, the hf backends, the chat
data components): packed micro-batches (`data.pack_tokens`) and the vllm generation engine, each
with the reason where it cannot, for the recipe check to name. `Family` is the recipe's type; tests
check it lists the same names, in the same order. Qwen3-VL is the dense model (`qwen3_vl`), not its
MoE sibling (`qwen3_vl_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from vlmrun.errors import InputError

Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "nemotron_omni"]
#: The fields of `Capabilities`.
Capability = Literal["packing", "vllm"]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What vlmrun runs a family's models with, each None where it can, else why it cannot (in the
    words the recipe check gives): `packing` data.pack_tokens (models/packing.py); `vllm`
    generation.backend: vllm (vLLM's class of the family takes the policy's names and the embeddings
    of our processor's pixels: tests/test_vllm_lane_engine.py, vlmrun/generation/vllm_engine.py)."""

    packing: str | None = None
    vllm: str | None = None


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """`model_types`: the `model_type` values of the config.json of a model directory of this family."""

    name: str
    processor_class: str
    model_types: tuple[str, ...]
    token_keys: tuple[str, ...]
    media_keys: tuple[str, ...]
    capabilities: Capabilities = Capabilities()


def _qwen(name: str, processor_class: str, capabilities: Capabilities = Capabilities()) -> FamilySpec:
    """A Qwen-VL family: its model_type is its name; per-token `mm_token_type_ids`, packed pixels and grids."""
    return FamilySpec(
        name=name,
        processor_class=processor_class,
        model_types=(name,),
        token_keys=("mm_token_type_ids",),
        media_keys=("pixel_values", "image_grid_thw"),
        capabilities=capabilities,
    )


_SPECS = (
    _qwen("qwen2_vl", "Qwen2VLProcessor"),
    _qwen("qwen2_5_vl", "Qwen2_5_VLProcessor"),
    _qwen(
        "qwen3_vl",
        "Qwen3VLProcessor",
        Capabilities(
            vllm="not checked yet: its vision tower also feeds deepstack features to the decoder, which the "
            "image-embeddings route must carry"
        ),
    ),
    FamilySpec(
        name="nemotron_omni",
        processor_class="NemotronH_Omni_Reasoning_V3Processor",
        model_types=("nemotron_h_omni",),
        token_keys=(),
        media_keys=("pixel_values", "image_grid_hw"),
        capabilities=Capabilities(
            packing="its Mamba layers carry their state along the row (transformers' path has no reset at a "
            "sequence's start), so a packed sequence would start from the previous one's state",
            vllm="vLLM names its class NemotronH_Nano_Omni_Reasoning_V3, needs the MoE kernels, and at 30B "
            "an engine over several GPUs: tensor parallel, not built",
        ),
    ),
)
FAMILIES = MappingProxyType({spec.name: spec for spec in _SPECS})


def family_spec(family: str) -> FamilySpec:
    """The spec of `family`; `InputError` on `model.family` listing the known families."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise InputError("model.family", family, f"allowed: {', '.join(FAMILIES)}") from None


def family_of_model_type(model_type: str) -> str | None:
    """The family whose model directories have this config.json `model_type`; None when no family's do."""
    return next((name for name, spec in FAMILIES.items() if model_type in spec.model_types), None)


def families_that(capability: Capability) -> tuple[str, ...]:
    """The families whose `capabilities.<capability>` has no refusal, in registry order."""
    return tuple(name for name, spec in FAMILIES.items() if getattr(spec.capabilities, capability) is None)
