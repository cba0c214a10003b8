"""Build a transformers VLM from a `ModelSpec`: the one place a backend of the `hf` family makes its model.

1. From a directory: `AutoModelForImageTextToText.from_pretrained` in the spec's dtype, on the CPU;
   the caller moves (or shards) it.
2. From a config, replicated: random init from the spec's seed directly on the target device (no
   host copy), with the global RNG left as it was.
3. From a config, to be sharded: built on the meta device (no memory at all); the caller shards it,
   then `materialize` allocates each rank's own shards on its device and initializes them (the
   model's own `_init_weights`, rotary buffers included, under the spec's seed). On a CUDA mesh DTensor's
   RNG gives the values an unsharded build would; on a CPU mesh each rank draws its shards from the
   same seed, a valid init but not the unsharded one.
4. From a directory, to be sharded: built on the meta device from the directory's config, like 3;
   `materialize` with the `LoadPlan` of `sharded_load.plan_load` then reads each rank's own rows from
   the safetensors files (sharded_load.py), and computes only the buffers the files do not hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from vlmrun.config.dtype import torch_dtype
from vlmrun.models.sharded_load import LoadPlan, load_shards, plan_name
from vlmrun.models.spec import ModelSpec


def build_model(spec: ModelSpec, *, device: torch.device | str = "cpu", on_meta: bool = False) -> torch.nn.Module:
    """The model of `spec`: loaded from its directory (on the CPU, whatever `device`), or random-init
    from its config on `device`. With `on_meta`, either is built on the meta device from its config
    (nothing read, nothing allocated): call `materialize` after sharding."""
    from transformers import AutoModelForImageTextToText

    dtype = torch_dtype(spec.dtype)
    if spec.directory is not None and not on_meta:
        return AutoModelForImageTextToText.from_pretrained(
            spec.directory, dtype=dtype, attn_implementation=spec.attn_implementation
        )
    config = _config(spec)
    target = torch.device("meta") if on_meta else torch.device(device)
    with _seeded(spec.seed, target), target:
        model = AutoModelForImageTextToText.from_config(
            config, dtype=dtype, attn_implementation=spec.attn_implementation
        )
    if spec.directory is not None:
        _directory_generation_config(model, spec.directory)
    return model


def save_model_directory(model: torch.nn.Module, spec: ModelSpec, out: Path) -> None:
    """`model` as a transformers model directory at `out` (config, generation config, safetensors), with
    the processor, tokenizer and chat template of the spec's directory beside it (none for a config-built
    model without one)."""
    from transformers import AutoProcessor

    model.save_pretrained(out)
    if spec.directory is not None:
        AutoProcessor.from_pretrained(spec.directory).save_pretrained(out)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off inside the block, as they were after it: a command that prints its
    result (an export) would otherwise fill stderr with load and save bars."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def materialize(
    model: torch.nn.Module, spec: ModelSpec, device: torch.device, plan: LoadPlan | None = None
) -> torch.nn.Module:
    """Allocate a meta-device model (sharded or not) on `device`: random-init from `spec.seed`, or,
    with the `plan` of its directory, every parameter and persistent buffer read from the files (each
    rank its own rows) and only the other buffers (rotary frequencies) computed."""
    model.to_empty(device=device)
    for module in model.modules():  # the meta build ran no init: let every module take its own
        module._is_hf_initialized = False
    if plan is not None:  # transformers' init functions skip a tensor so marked: the files fill it
        for name, tensor in model.state_dict(keep_vars=True).items():
            if plan_name(name) in plan.sources:
                tensor._is_hf_initialized = True
    with _seeded(spec.seed, device):
        model.initialize_weights()
    if plan is not None:
        load_shards(model, plan)
    model.tie_weights()
    return model


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A meta-device model on `device` with only its buffers computed (rotary frequencies): its
    parameters are allocated but hold no values, for an engine whose weights all come from a refit."""
    model.to_empty(device=device)
    for module in model.modules():
        module._is_hf_initialized = False
    for param in model.parameters():  # transformers' init functions skip a tensor so marked
        param._is_hf_initialized = True
    model.initialize_weights()
    model.tie_weights()
    return model


def _config(spec: ModelSpec):
    from transformers import AutoConfig

    if spec.directory is not None:
        return AutoConfig.from_pretrained(spec.directory)
    values = dict(spec.config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _directory_generation_config(model: torch.nn.Module, directory: str) -> None:
    """The directory's generation config, as `from_pretrained` would have set it."""
    from pathlib import Path

    from transformers import GenerationConfig

    if (Path(directory) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG seeded with `seed` for the block, then put back as it was."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
