"""LoRA adapters on the hf policy's model (`model.lora`), through peft: which layers, their start, their merge.

1. peft wraps the chosen linear layers in place (`inject_adapter_in_model`): the model keeps its
   transformers class, so the FSDP2 units, the shared-image pass and `generate` see the model they know.
   A wrapped layer's weight is named `<layer>.base_layer.weight`; its adapters `<layer>.lora_A.default.weight`
   ([r, in]) and `<layer>.lora_B.default.weight` ([out, r]). The layer computes
   `base(x) + scale * B(A(dropout(x)))`, scale = alpha / r.
2. Which layers (`target_modules`): the language model's decoder layers' linear layers of the named set,
   the vision tower's block layers (`vision`), the projector's (`projector`); never the LM head or the
   embeddings. Nemotron-Omni's routed experts are fused 3-D parameters, not linear layers: no adapter
   reaches them (its attention, Mamba projections and shared experts are reached).
3. The adapters start from the run's seed, drawn whole on the CPU in the layers' order (`init_adapters`):
   the same values replicated or sharded, on any number of ranks, in v1 and v2. B is zero, so the model
   starts as the base exactly.
4. Merged weights (`merged_tensors`): each wrapped weight as W + scale * (B @ A) under its base name, the
   adapters' names dropped: what an engine without adapters, or an export, takes. One layer at a time.
5. The base alone (`adapters_off`): the same model with its adapters skipped, GRPO's reference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vlmrun.models.sharded_load import LORA_WRAPPED, WRAPPED, is_adapter
from vlmrun.policy.refit_stream import state_tensors

ADAPTER = "default"  # peft's name for the one adapter
#: The decoder layers' linear layers of each named set (the language model's, every family's names).
LM_SETS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
#: Words that mark the vision tower (Qwen `visual`, Nemotron-Omni `vision_model`), its blocks, the projector.
_TOWER, _BLOCKS, _PROJECTOR = ("visual", "vision_model"), ("blocks", "layer", "layers"), ("merger", "projector")


class NoAdapterTarget(ValueError):
    """The model has no linear layer that the recipe's `model.lora` sets reach."""


def base_name(name: str) -> str:
    """The base model's name of a wrapped model's tensor (`x.base_layer.weight` -> `x.weight`)."""
    return name.replace(LORA_WRAPPED, ".")


def target_modules(model: torch.nn.Module, lora: Mapping[str, Any]) -> list[str]:
    """The full names of the linear layers `lora` (model.lora's settings) puts adapters on."""
    wanted = LM_SETS.get(lora["targets"])  # None: all_linear
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if any(w in p for p in parts for w in _PROJECTOR):
            chosen = lora["projector"]
        elif any(p in _TOWER for p in parts):
            chosen = lora["vision"] and any(p in _BLOCKS for p in parts)
        elif "language_model" in parts and "layers" in parts:
            chosen = wanted is None or parts[-1] in wanted
        else:
            chosen = False
        if chosen:
            out.append(name)
    if not out:
        raise NoAdapterTarget(
            f"{type(model).__name__}: model.lora.targets {lora['targets']!r} reaches no linear layer of its "
            "language model (peft wraps torch.nn.Linear layers only)"
        )
    return out


def peft_config(model: torch.nn.Module, lora: Mapping[str, Any]):
    """peft's LoraConfig for `lora` on `model` (its targets named in full)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=target_modules(model, lora),
        init_lora_weights="gaussian" if lora["init"] == "gaussian" else True,
        bias="none",
    )


def add_adapters(model: torch.nn.Module, lora: Mapping[str, Any]) -> torch.nn.Module:
    """Wrap `model`'s target layers in place (on whatever device it is, the meta device too) and freeze
    everything but the adapters; their values are set by `init_adapters` next (peft's own draw is
    discarded: it runs on a forked RNG, so the global stream is untouched)."""
    from peft import inject_adapter_in_model

    config = peft_config(model, lora)
    with torch.random.fork_rng(devices=[]):
        # peft puts the adapters in the base layer's dtype: FSDP2 gathers a unit's parameters in one dtype
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, layer) of every peft-wrapped layer, in the model's order."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


@torch.no_grad()
def init_adapters(model: torch.nn.Module, lora: Mapping[str, Any], seed: int) -> None:
    """Every adapter's start from `seed`, whole on the CPU: A peft's default (uniform in +-1/sqrt(in), what
    its kaiming-uniform with a = sqrt(5) draws) or gaussian (std 1/r); B zero. Sharded adapters take their
    rows of the whole tensor."""
    gen = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(model):
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        r, n_in = a.shape
        if lora["init"] == "gaussian":
            whole = torch.randn(r, n_in, generator=gen) / r
        else:
            bound = 1.0 / math.sqrt(n_in)
            whole = torch.rand(r, n_in, generator=gen) * (2 * bound) - bound
        _fill(a, whole)
        _fill(b, torch.zeros(b.shape))


def _fill(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Write the whole tensor `whole` into `param` (a plain tensor, or this rank's part of a DTensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        mine = distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    else:
        param.copy_(whole.to(param.dtype))


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * (B @ A), the product taken in fp32 and cast to W's dtype before the sum (peft's merge)."""
    delta = (b.float() @ a.float()) * scale
    return weight + delta.to(weight.dtype)


def merged_tensors(model: torch.nn.Module, whole) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state as the base names it, each wrapped layer's weight merged with its adapters as it
    is drawn (one layer at a time), a tied weight once; `whole(t)` gives a (possibly sharded) tensor whole.
    Collective when sharded: every rank draws the same tensors in the same order."""
    # state_dict names drop activation checkpointing's wrapper, which module names keep
    layers = {name.replace(WRAPPED, ""): layer for name, layer in lora_layers(model)}
    for name, t in state_tensors(model):
        if is_adapter(name):
            continue
        owner = name.rsplit(LORA_WRAPPED, 1)[0] if LORA_WRAPPED in name else None
        layer = layers.get(owner) if owner is not None else None
        if layer is None or not name.endswith(".base_layer.weight"):
            yield base_name(name), t
            continue
        a, b = whole(layer.lora_A[ADAPTER].weight.detach()), whole(layer.lora_B[ADAPTER].weight.detach())
        yield base_name(name), merged_weight(whole(t.detach()), a, b, layer.scaling[ADAPTER])


def adapter_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters' entries of a model state dict: what a LoRA checkpoint holds of the model."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def load_adapters(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load a checkpoint's adapters into `model` (the base left as it is); RuntimeError when the state
    lacks one of the model's adapters or holds anything else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    lacking = sorted(adapter_state(dict.fromkeys(missing)))
    if unexpected or lacking:
        raise RuntimeError(f"LoRA checkpoint: adapters missing {lacking}, unexpected {sorted(unexpected)}")


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model alone for the block: every wrapped layer skips its adapters (GRPO's reference)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def no_adapter_dropout(model: torch.nn.Module) -> Iterator[None]:
    """Adapter dropout off for a scoring forward that runs in train mode (hf.py `logprobs`)."""
    dropouts = [d for _, layer in lora_layers(model) for d in layer.lora_dropout.values() if d.training]
    for d in dropouts:
        d.eval()
    try:
        yield
    finally:
        for d in dropouts:
            d.train()
