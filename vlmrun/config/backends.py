"""What each policy and generation backend supports: the one place a backend's name is spelled.

`model.backend` and `generation.backend` take these names; the factories (`vlmrun.policy.open_policy`,
`vlmrun.generation.open_generator`) import the `entry` of the one chosen. The recipe asks a backend's
capabilities (`PolicyCapabilities.refusal`) instead of comparing backend names: a new backend is a
new entry here, with what it can and cannot run, each refusal in the words the recipe check gives.
Light on purpose (no torch): the recipe validates against it on a login node.

What a layout needs of the model itself (tp dividing the attention heads and the vocabulary, pp the
layers) is checked where the model's config is read at submit (models/layout_check.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: The parallel axes a backend may run above 1 (config/layout.py's).
AXES = ("dp", "tp", "pp", "cp", "ep")


@dataclass(frozen=True, kw_only=True)
class PolicyCapabilities:
    """What a policy backend runs. `families`: family -> why it cannot run it (absent: it
    can). `axes`: the parallel axes it may run above 1. Each other field: None where it runs that
    recipe setting, else why not (`experts`: parallel.ep, spreading a mixture of experts' experts; `lora`:
    model.lora, adapters on a frozen base). `storage`: the checkpoint storage kinds it writes (checkpoint/parts.py)."""

    families: Mapping[str, str] = field(default_factory=dict)
    axes: tuple[str, ...] = ("dp",)
    fsdp: str | None = None
    sequence_parallel: str | None = None
    packing: str | None = None
    experts: str | None = "runs no mixture of experts"
    storage: tuple[str, ...] = ("replicated",)
    lora: str | None = "trains every weight only"


@dataclass(frozen=True, kw_only=True)
class PolicyBackendSpec:
    """A policy backend: `entry` is "module:class" of its PolicyBackend; `about` one line for `--help`."""

    entry: str
    about: str
    capabilities: PolicyCapabilities


@dataclass(frozen=True, kw_only=True)
class GenerationBackendSpec:
    """A generation backend: `entry` is "module:class" of its GenerationBackend."""

    entry: str
    about: str


_HF = PolicyBackendSpec(
    entry="vlmrun.policy.hf:HfPolicy",
    about="transformers, replicated or FSDP2 / HSDP over the dp ranks",
    capabilities=PolicyCapabilities(
        axes=("dp",),
        sequence_parallel="shards by data parallelism only: use model.backend: megatron for tensor parallelism",
        storage=("replicated", "sharded"),
        lora=None,
    ),
)
_MEGATRON = PolicyBackendSpec(
    entry="vlmrun.policy.megatron.backend:MegatronPolicy",
    about="megatron-core GPTModel with the HF vision tower: tensor, pipeline and sequence parallel",
    capabilities=PolicyCapabilities(
        families={
            "qwen3_vl": "its vision tower feeds deepstack features into the first decoder layers and its mRoPE "
            "interleaves the axes; megatron-core 0.16.1's GPTModel has neither (use model.backend: hf)",
            "nemotron_omni": "its Mamba layers need megatron-core's Mamba stack with the mamba-ssm kernels on "
            "CUDA, not built (use model.backend: hf)",
        },
        axes=("dp", "tp", "pp", "ep"),
        fsdp="shards by tensor and pipeline parallelism, not FSDP2: set parallel.fsdp: false",
        experts="spreads experts, and no family it runs has any (Qwen2-VL and Qwen2.5-VL are dense; the "
        "mixture-of-experts Nemotron-Omni needs Mamba layers it cannot build)",
        storage=("pieces",),
        lora="trains every weight only: its mcore layers have no adapters (peft wraps transformers' modules); "
        "use model.backend: hf for LoRA",
    ),
)

#: model.backend -> its spec.
POLICY_BACKENDS = MappingProxyType({"hf": _HF, "megatron": _MEGATRON})
#: generation.backend -> its spec.
GENERATION_BACKENDS = MappingProxyType(
    {
        "hf": GenerationBackendSpec(entry="vlmrun.generation.hf:HfGenerator", about="transformers generate"),
        "vllm": GenerationBackendSpec(entry="vlmrun.generation.vllm:VllmGenerator", about="vLLM's engine"),
    }
)
#: The names a recipe field may take, in registry order (its Literal type).
POLICY_BACKEND_NAMES = tuple(POLICY_BACKENDS)
GENERATION_BACKEND_NAMES = tuple(GENERATION_BACKENDS)


def entries(specs: Mapping) -> dict[str, str]:
    """name -> "module:class", what `config.registry.load_entry` imports."""
    return {name: spec.entry for name, spec in specs.items()}


def policy_refusal(recipe) -> tuple[str, object, str] | None:
    """(field, value, why) of the first recipe setting `model.backend` cannot run, or None."""
    name, p = recipe.model.backend, recipe.parallel
    caps = POLICY_BACKENDS[name].capabilities
    if (why := caps.families.get(recipe.family)) is not None:
        return "model.backend", name, f"cannot run model.family {recipe.family!r}: {why}"
    if p.ep > 1 and caps.experts is not None and "ep" in caps.axes:
        return "parallel.ep", p.ep, f"model.backend {name} {caps.experts}: there are no experts to spread"
    for axis in AXES:
        size = getattr(p, axis)
        if size > 1 and axis not in caps.axes:
            runs = ", ".join(n for n, s in POLICY_BACKENDS.items() if axis in s.capabilities.axes) or "no backend"
            return f"parallel.{axis}", size, f"model.backend {name} runs parallel.{axis} 1 ({axis} > 1: {runs})"
    if recipe.model.lora is not None and caps.lora is not None:
        return "model.lora", recipe.model.lora.rank, f"model.backend {name} {caps.lora}"
    if p.fsdp and caps.fsdp is not None:
        return "parallel.fsdp", True, f"model.backend {name} {caps.fsdp}"
    if p.sequence_parallel and caps.sequence_parallel is not None:
        return "parallel.sequence_parallel", True, f"model.backend {name} {caps.sequence_parallel}"
    if p.sequence_parallel and p.tp == 1:
        return (
            "parallel.sequence_parallel",
            True,
            "splits the sequence over the tensor-parallel ranks: needs parallel.tp > 1",
        )
    return None
