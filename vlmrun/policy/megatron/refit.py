"""The megatron backend's weights as a refit takes them: whole HF tensors by HF name, bucket by bucket.

A replica's generation engine lives on its first rank (tensor-parallel rank 0 of the first pipeline
stage: `MegatronPolicy.receives_refit`). Every rank of the replica draws the same buckets in the same
order (collective), HF tensor by HF tensor, stage by stage:

1. the stage that holds the tensor casts its piece to the engine's dtype and, under tensor
   parallelism, all-gathers the pieces over its tensor-parallel group into the whole tensor (mapping.py
   says where each piece sits: `whole`);
2. a tensor of a later stage goes from that stage's tensor-parallel rank 0 to the replica's first
   rank, point to point (its shape is the HF model's, which every rank knows from the meta-device
   build), straight into the engine's own tensor where `into` offers one of that shape and dtype;
3. the first rank's buckets hold the tensors (at most `bucket_bytes` of them, a larger tensor alone,
   as policy/refit_stream.py bounds them: one bucket of whole tensors alive at a time); every other
   rank's buckets are empty, one per bucket of the first rank's, and it drains them.

The tied head's copy is never sent: the embedding is (under its HF name, as the hf backend sends a
tied weight once).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from vlmrun.policy.megatron.mapping import ParamMap, stage_params, stage_plan


def refit_buckets(
    policy, *, dtype: str | None, bucket_bytes: int, into: Mapping[str, torch.Tensor] | None
) -> Iterator[dict[str, torch.Tensor]]:
    """The refit's buckets, every rank of the replica drawing them in order. `dtype`: the engine's dtype name (None: the policy's own)."""
    from vlmrun.config.dtype import torch_dtype

    want = torch_dtype(dtype) if dtype is not None else policy.opts.dtype
    shapes = {n: tuple(t.shape) for n, t in policy.built.meta_model.state_dict().items()}
    receiver = policy.receives_refit
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for stage, m, name in _order(policy):
        target = (into or {}).get(name) if receiver else None
        if target is not None and (tuple(target.shape) != shapes[name] or target.dtype != want):
            target = None
        nbytes = 0 if target is not None else _numel(shapes[name]) * want.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket if receiver else {}
            bucket, size = {}, 0
        tensor = _whole_on_first_rank(policy, stage, m, name, want, shapes[name], target)
        if receiver:
            bucket[name] = tensor
        size += nbytes
    if bucket or size:
        yield bucket if receiver else {}


def _order(policy) -> Iterator[tuple[int, ParamMap, str]]:
    """(stage, map, HF name) of every tensor sent, stage by stage, in each stage's map order."""
    shape = policy.built.shape
    visual = [n for n, _ in policy.built.shell.visual.named_parameters()]
    for s in range(policy.ranks.pp):
        plan = stage_plan(shape, s, policy.ranks.pp)
        for m in stage_params(shape, plan, visual, fused_norms=policy.built.fused_norms):
            if not m.copy:
                for name in m.hf:
                    yield s, m, name


def _whole_on_first_rank(
    policy,
    stage: int,
    m: ParamMap,
    name: str,
    want: torch.dtype,
    shape: tuple[int, ...],
    target: torch.Tensor | None,
) -> torch.Tensor | None:
    """The whole HF tensor `name` on the replica's first rank: gathered over tp by its stage, sent
    there from a later stage; None elsewhere."""
    c, r = policy.coords, policy.ranks
    mine = None
    if c.pp == stage:
        local = policy.built.params_by_name()[m.mcore].detach()
        part = m.to_hf(local)[name].to(want).contiguous()
        mine = _gathered(part, m.split, policy.groups.grads.tp, r.tp, out=target if stage == 0 else None)
    if stage == 0:
        return mine if policy.receives_refit else None
    first = r.rank_of(dp=c.dp, tp=0, pp=0)
    if c.pp == stage and c.tp == 0:
        dist.send(mine, dst=first)
    elif policy.receives_refit:
        out = target if target is not None else torch.empty(shape, dtype=want, device=policy.device)
        dist.recv(out, src=r.rank_of(dp=c.dp, tp=0, pp=stage))
        return out
    return None


def _gathered(part: torch.Tensor, split: int | None, group, tp: int, out: torch.Tensor | None) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's `part` (cat along `split`), into `out` if given."""
    if split is None or tp == 1 or group is None:
        return out.copy_(part) if out is not None else part
    parts = [torch.empty_like(part) for _ in range(tp)]
    dist.all_gather(parts, part, group=group)
    if out is not None:
        return torch.cat(parts, dim=split, out=out)
    return torch.cat(parts, dim=split)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
