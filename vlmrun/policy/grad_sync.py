"""Data-parallel gradient sum over torch.distributed, in one flat all-reduce per step.

We sum (not average) because the loss is already divided by the step's global token count; one flat
buffer in a fixed parameter order keeps the reduction deterministic, and parameters that got no
gradient this step (the vision tower on a text-only micro-batch) contribute zeros instead of
breaking the collective the way DDP's unused-parameter check would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few float64 scalars across ranks (token counts, loss sums, correct answers)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_extreme(values: list[float], *, largest: bool) -> list[float]:
    """The max (`largest`) or min of a few float64 scalars across ranks (ratio bounds)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)
    return t.tolist()
