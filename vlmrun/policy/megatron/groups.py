"""The megatron backend's process groups and the collectives its results need.

megatron-core's parallel state is set up in the layout's own order ("tp-cp-ep-dp-pp": config/layout.py),
so its data-parallel rank is our replica. Beside megatron's groups, one of our own: the *result ranks*,
tensor-parallel rank 0 of the last pipeline stage of each replica, where a step's loss, its statistics
and the logprobs are whole. Every rank returns the same numbers: the result ranks reduce them over
the replicas and the first of them broadcasts them (`results`); a forward's logprobs go from the last
stage to the other stages of its pipeline (`from_last_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlmrun.config.layout import RankCoords, RankLayout
from vlmrun.policy.loss import LossStats
from vlmrun.policy.megatron.grads import GradGroups, groups_of_megatron


@dataclass
class Groups:
    """This rank's place, megatron's groups and the result ranks' group; built by `initialize`."""

    layout: RankLayout
    coords: RankCoords
    grads: GradGroups
    results_group: object | None
    first_result_rank: int
    pipeline: object | None
    last_stage_rank: int

    @property
    def holds_results(self) -> bool:
        return self.coords.tp == 0 and self.coords.pp == self.layout.pp - 1

    def replica_sum(self, values: list[float]) -> list[float]:
        """`values` (the same on every rank of a replica) summed over the replicas, float64."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.grads.dp is not None:
            dist.all_reduce(t, group=self.grads.dp)
        return t.tolist()

    def results(self, loss_sum: float, stats: LossStats) -> tuple[float, dict[str, float]]:
        """(the summed loss, every statistic) over all replicas, reduced by the result ranks and broadcast
        from the first of them: the same on every rank."""
        payload: list = [None]
        if self.holds_results:
            total = torch.tensor([loss_sum], dtype=torch.float64)
            if self.results_group is not None:
                dist.all_reduce(total, group=self.results_group)
            payload = [(float(total[0]), _reduced(stats, self.results_group))]
        if self.layout.world_size > 1:
            dist.broadcast_object_list(payload, src=self.first_result_rank)
        return payload[0]

    def from_last_stage(self, tensor: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
        """The last stage's `tensor` (float32, `shape`) on every stage of this rank's pipeline."""
        if self.pipeline is None:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=torch.float32, device=device)
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=self.last_stage_rank, group=self.pipeline)
        return tensor


def _reduced(stats: LossStats, group) -> dict[str, float]:
    """LossStats.reduced over `group` (the result ranks) instead of every rank."""
    out: dict[str, float] = {}
    sums, mins, maxs = stats.on_host()
    for values, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN), (maxs, dist.ReduceOp.MAX)):
        keys = sorted(values)
        if not keys:
            continue
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(t, op=op, group=group)
        out |= dict(zip(keys, t.tolist(), strict=True))
    return out


def initialize(layout: RankLayout, *, seed: int) -> Groups:
    """megatron-core's parallel state for `layout` over the default process group (joined before), the
    CPU shims and RNG tracker where CUDA is absent, and our result group (collective: every rank)."""
    from megatron.core import parallel_state as ps

    from vlmrun.policy.megatron.cpu_shims import apply_cpu_shims, install_cpu_rng_tracker

    on_cpu = apply_cpu_shims()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=False,
    )
    tp_rank = ps.get_tensor_model_parallel_rank()
    if on_cpu:
        install_cpu_rng_tracker(seed, tp_rank=tp_rank)
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    coords = layout.coords(dist.get_rank())
    result_ranks = [layout.rank_of(dp=d, tp=0, pp=layout.pp - 1) for d in range(layout.dp)]
    results_group = dist.new_group(result_ranks) if layout.dp > 1 else None
    pipeline = ps.get_pipeline_model_parallel_group() if layout.pp > 1 else None
    return Groups(
        layout=layout,
        coords=coords,
        grads=groups_of_megatron(),
        results_group=results_group,
        first_result_rank=result_ranks[0],
        pipeline=pipeline,
        last_stage_rank=ps.get_pipeline_model_parallel_last_rank(),
    )


def destroy() -> None:
    """Tear megatron-core's parallel state down (before the process group goes)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
