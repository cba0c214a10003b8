"""The HF weights a megatron stage is filled from, read by HF name (mapping.py says which pieces).

1. From a model directory: each HF tensor read from the safetensors files by its in-memory name
   (transformers' own renames: models/sharded_load.py's plan over an HF model built on the meta
   device), one tensor at a time, then cut to this rank's piece: a rank holds its pieces and one
   whole tensor at most, never the model. A directory that plan cannot read is loaded whole once.
2. From a config (random init): transformers builds the model from the spec's seed on the CPU, the
   same weights the hf backend starts from, and the stage takes its pieces of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmrun.models.spec import ModelSpec
from vlmrun.policy.megatron.mapping import ParamMap, piece


def hf_reader(spec: ModelSpec, meta_model: torch.nn.Module) -> tuple[Callable[[str], torch.Tensor], str]:
    """(read(hf name) -> the whole tensor on the CPU in the spec's dtype, how the weights are read)."""
    from vlmrun.config.dtype import torch_dtype
    from vlmrun.models.build import build_model

    dtype = torch_dtype(spec.dtype)
    if spec.directory is not None:
        from vlmrun.models import sharded_load

        plan, why = sharded_load.plan_load(meta_model, spec.directory)
        if plan is not None:
            return _from_files(plan, dtype), "each rank read its own pieces of the weights' files"
        whole_model = build_model(spec)
        load = f"whole on every rank: {why}"
    else:
        whole_model = build_model(spec)
        load = f"random init (seed {spec.seed}), each rank its own pieces"
    state = whole_model.state_dict()
    return (lambda name: state[name]), load


def _from_files(plan, dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    from vlmrun.models.sharded_load import read_rows

    def read(name: str) -> torch.Tensor:
        source = plan.sources[name]
        if source.fused:
            raise ValueError(f"{name}: a fused expert tensor (not a Qwen2-VL / Qwen2.5-VL weight)")
        disk = plan.files[source.keys[0]]
        rows = disk.shape[0] // source.chunks if disk.shape else 1
        out = torch.empty((rows, *disk.shape[1:]) if disk.shape else (), dtype=dtype)
        read_rows(disk, source.offset, out)
        return out

    return read


def fill_stage(
    params: dict[str, torch.nn.Parameter],
    maps: list[ParamMap],
    read: Callable[[str], torch.Tensor],
    *,
    tp_rank: int,
    tp: int,
) -> None:
    """Every parameter of the stage from the HF tensors its map names (its pieces of them); ValueError
    when the stage's parameters and the maps do not name the same tensors, or a shape differs."""
    named = {m.mcore for m in maps}
    if named != set(params):
        raise ValueError(
            f"the HF <-> megatron mapping misses {sorted(set(params) - named)[:3]} and names "
            f"{sorted(named - set(params))[:3]} the stage lacks"
        )
    with torch.no_grad():
        for m in maps:
            local = m.from_hf({n: piece(read(n), m.split, tp_rank, tp) for n in m.hf})
            target = params[m.mcore]
            if tuple(local.shape) != tuple(target.shape):
                raise ValueError(f"{m.mcore}: {tuple(local.shape)} from {m.hf}, {tuple(target.shape)} in the stage")
            target.copy_(local)
