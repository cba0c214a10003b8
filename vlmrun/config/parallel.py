"""The recipe's `parallel` section: the sizes of the policy's rank layout (`layout`: the one layout
type, config/layout.py, that the topology mapper, the worker group, the fit check and the policy's
mesh read), plus how the hf backend shards and stores the model on those ranks (FSDP2, mixed
precision, activation checkpointing, CPU offload)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from vlmrun.config.layout import RankLayout
from vlmrun.config.section import Section


class ParallelConfig(Section):
    """Data, tensor, pipeline and context parallel sizes; experts live inside dp x tp.

    Frozen and keyword-only; each size is an integer >= 1 (`true` is not 1: a ValidationError names
    the size). `fsdp` None means: on when the cluster has GPUs (the recipe resolves it).
    """

    model_config = ConfigDict(frozen=True)

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(
        1, ge=1, description="expert parallelism: a mixture of experts' experts spread over groups of ep ranks of dp"
    )
    sequence_parallel: bool = Field(
        False,
        description="model.backend megatron: split the activations outside attention and the MLP along the "
        "sequence over the tp ranks (needs tp > 1)",
    )
    fsdp: bool | None = Field(
        None,
        description="shard parameters, gradients and optimizer state over the dp ranks with FSDP2 "
        "(true), or keep a full replica per rank (false); default: true when the cluster has GPUs",
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        "none",
        description="bf16: compute in bf16 with fp32 gradient reduction, over model.dtype master weights "
        "(needs fsdp: true)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer in the backward (megatron: full recompute, one layer at a time)",
    )
    cpu_offload: bool = Field(False, description="keep sharded parameters and optimizer state in host memory (fsdp)")
    offload_during_generation: bool = Field(
        False,
        description="GRPO: move the policy's optimizer state to host memory before each rollout's refit and its "
        "weights (the reference model's too) right after it, and both back once the engine has generated, so "
        "the engine's weights and KV cache have the GPU to themselves (the memory check counts the rollout "
        "without them, the host with them); on a CPU rank the host is the device: the same moves, no memory "
        "freed",
    )
    dp_shard: int | None = Field(
        None,
        ge=1,
        description="HSDP: shard over groups of this many consecutive dp ranks (one node's GPUs) and replicate "
        "across the dp / dp_shard groups (gradients reduce-scattered inside a group, all-reduced across "
        "groups); must divide dp and needs fsdp: true; default: one group of every dp rank (plain FSDP)",
    )
    reduce_every_micro_batch: bool = Field(
        False,
        description="fsdp: reduce-scatter gradients after every micro-batch, so they stay sharded (what big "
        "models need); default: once per step, after the last micro-batch, which holds the whole model's "
        "gradients unsharded in between and is bitwise equal to the replicated layout",
    )

    @property
    def layout(self) -> RankLayout:
        """The rank layout of these sizes (call it once the recipe validated dp_shard)."""
        return RankLayout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp_shard=self.dp_shard)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def sharded(self) -> bool:
        """FSDP2 on (after the recipe resolved the default)."""
        return bool(self.fsdp)
