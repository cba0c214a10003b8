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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vlmrun.config.dtype import torch_dtype
from vlmrun.models.spec import ModelSpec


def build_model(spec: ModelSpec, *, device: torch.device | str = "cpu", on_meta: bool = False) -> torch.nn.Module:
    """The model of `spec`: loaded from its directory (on the CPU, whatever `device`), or random-init
    from its config on `device` (on the meta device with `on_meta`: call `materialize` after sharding)."""
    from transformers import AutoModelForImageTextToText

    dtype = torch_dtype(spec.dtype)
    if spec.directory is not None:
        return AutoModelForImageTextToText.from_pretrained(spec.directory, dtype=dtype)
    config = _config(spec)
    target = torch.device("meta") if on_meta else torch.device(device)
    with _seeded(spec.seed, target), target:
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def materialize(model: torch.nn.Module, spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """Allocate a meta-device model (sharded or not) on `device` and random-init it from `spec.seed`."""
    model.to_empty(device=device)
    for module in model.modules():  # the meta build ran no init: let every module take its own
        module._is_hf_initialized = False
    with _seeded(spec.seed, device):
        model.initialize_weights()
    model.tie_weights()
    return model


def _config(spec: ModelSpec):
    from transformers import AutoConfig

    values = dict(spec.config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG seeded with `seed` for the block, then put back as it was."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
