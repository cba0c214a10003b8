"""Our gradient sync and gradient norm for the megatron backend (megatron's DDP and optimizer want CUDA
tensors: FACTS "megatron-core on CPU"), with torch AdamW over the stage's parameters.

1. Sync, after the step's last backward, in this order:
   a. norms under sequence parallelism (`p.sequence_parallel`): each tensor-parallel rank saw its part
      of the sequence, so their gradients are partial sums: summed over the tensor-parallel group;
   b. a tied head: the embedding's gradient and its copy's (the output layer: mapping.py) summed, in
      this process (one stage) or over megatron's embedding group (first and last stage), so both
      hold the same gradient and take the same AdamW update;
   c. data parallelism: every gradient summed over the replicas in one flat all-reduce (the loss is
      divided by the step's global token count already), a parameter without gradient as zeros.
2. The norm counts every parameter once (stage.py marks them from the mapping: `vlmrun_tp_split`, a
   tensor-parallel shard; `vlmrun_tied_copy`, the head's copy): each pipeline stage its own, a tensor-parallel shard on
   every rank, a replicated parameter (norms, the vision tower) on tensor-parallel rank 0 only, the
   tied copy never; fp64 sums of squares, summed over the model-parallel group (tp x pp), the square
   root in fp32. Every rank gets the same norm, and clips with torch's coefficient (fsdp.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GradGroups:
    """The process groups a sync and a norm use (None: that axis has one rank)."""

    tp: object | None
    dp: object | None
    model_parallel: object | None
    embedding: object | None
    tp_rank: int


def groups_of_megatron() -> GradGroups:
    """The groups megatron-core's parallel state made for this rank (set up before)."""
    from megatron.core import parallel_state as ps

    def sized(group):
        return group if group is not None and dist.get_world_size(group) > 1 else None

    embedding = ps.get_embedding_group(check_initialized=False) if ps.is_rank_in_embedding_group() else None
    return GradGroups(
        tp=sized(ps.get_tensor_model_parallel_group()),
        dp=sized(ps.get_data_parallel_group()),
        model_parallel=sized(ps.get_model_parallel_group()),
        embedding=sized(embedding),
        tp_rank=ps.get_tensor_model_parallel_rank(),
    )


def sync_gradients(params: list[torch.nn.Parameter], tied: tuple | None, groups: GradGroups) -> None:
    """Sum the gradients over sequence-parallel norms, a tied head and the replicas, in that order. `tied`: (embedding, output layer) parameters this stage holds of a tied head
    (either may be None on a stage without it), or None when the head is untied."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if groups.tp is not None:
        for p in params:
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=groups.tp)
    if tied is not None:
        _sum_tied(tied, groups)
    if groups.dp is not None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=groups.dp)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def _sum_tied(tied: tuple, groups: GradGroups) -> None:
    embedding, output = tied
    if embedding is not None and output is not None:
        total = embedding.grad + output.grad
        embedding.grad.copy_(total)
        output.grad.copy_(total)
        return
    if groups.embedding is not None:
        held = embedding if embedding is not None else output
        dist.all_reduce(held.grad, group=groups.embedding)


def counts_in_norm(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank counts `p` in the gradient norm: a tensor-parallel shard on every rank, a replicated
    tensor on tp rank 0 only, the tied head's copy never."""
    if getattr(p, "vlmrun_tied_copy", False):
        return False
    return bool(getattr(p, "vlmrun_tp_split", False)) or tp_rank == 0


def grad_norm(params: list[torch.nn.Parameter], groups: GradGroups) -> float:
    """The L2 norm of the whole model's gradient, the same on every rank (each parameter counted once)."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None and counts_in_norm(p, groups.tp_rank):
            total += p.grad.detach().to(torch.float64).pow(2).sum()
    if groups.model_parallel is not None:
        dist.all_reduce(total, group=groups.model_parallel)
    return float(torch.tensor(math.sqrt(float(total)), dtype=torch.float32))


def clip_and_norm(params: list[torch.nn.Parameter], groups: GradGroups, max_norm: float, clip) -> float:
    """The gradient norm (`grad_norm`), gradients clipped to `max_norm` by `clip(params, norm, max_norm)`."""
    norm = grad_norm(params, groups)
    clip(params, norm, max_norm)
    return norm
