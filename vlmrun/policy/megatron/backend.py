"""The `megatron` policy backend: megatron-core's GPTModel with the HF vision tower in front, tensor and
pipeline parallel (sequence parallelism, activation recompute), on gloo/CPU or NCCL/GPU.

1. Ranks: `parallel.dp x tp x pp` ranks in megatron-core's order "tp-cp-ep-dp-pp" (config/layout.py's
   `RankLayout`, the worker group's too), so megatron's data-parallel rank is the worker group's replica.
   Each rank builds its pipeline stage (model.py) and fills it from the HF weights (weights.py,
   mapping.py); the CPU shims (cpu_shims.py) are applied first where CUDA is absent.
2. A step: every rank of a replica runs the replica's micro-batches (the worker group feeds them all)
   through megatron's schedule (schedule.py); the loss is summed over labelled tokens and divided by
   the step's global count of them (all replicas), as in the hf backend; then our gradient sync and
   norm (grads.py), torch's clipping coefficient, torch AdamW and the LR schedule (policy/optimizer.py).
   The loss, its statistics and the logprobs live on the last stage: they are summed over the replicas'
   tensor-parallel rank 0 of the last stage and broadcast, so every rank returns the same `StepResult`
   and `logprobs` gives every rank of a replica the same tensor.
3. Checkpoints, export and refit speak HF names (state.py, refit.py): a piece of an HF tensor is the
   same in every layout, which is what lets a checkpoint of one layout resume in another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vlmrun.checkpoint.parts import PolicyState
from vlmrun.config.layout import RankLayout
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import rng
from vlmrun.policy.device import join_process_group, rank_device, to_device
from vlmrun.policy.fsdp import clip_gradients
from vlmrun.policy.host_memory import StepPeak, trim
from vlmrun.policy.interface import REFIT_BUCKET_BYTES, PolicyBackend, StepResult, TokenLoss
from vlmrun.policy.loss import LossStats, NllLoss
from vlmrun.policy.megatron.model import StageOptions, stage_inputs
from vlmrun.policy.optimizer import build_optimizer


class MegatronPolicy(PolicyBackend):
    """Rank `rank` of `world_size` of the model `model`; `parallel` the recipe's parallel
    section (None: one rank, one stage: the export's and eval's policy). Built by `open_policy`."""

    def __init__(self, *, model: ModelSpec, rank: int, world_size: int, train, parallel=None, gpus: bool = False):
        self.rank, self.world_size, self.spec, self.train, self.gpus = rank, world_size, model, train, gpus
        self.ranks = RankLayout(
            dp=getattr(parallel, "dp", 1), tp=getattr(parallel, "tp", 1), pp=getattr(parallel, "pp", 1)
        )
        if self.ranks.world_size != world_size:
            raise ValueError(f"{self.ranks.describe()} is not {world_size} ranks")
        self.coords = self.ranks.coords(rank)
        self.opts = StageOptions(
            tp=self.ranks.tp,
            pp=self.ranks.pp,
            sequence_parallel=bool(getattr(parallel, "sequence_parallel", False)) and self.ranks.tp > 1,
            recompute=bool(getattr(parallel, "activation_checkpointing", False)),
            dtype=_dtype(model.dtype),
        )

    # ---- set-up ----------------------------------------------------------------------------------
    def setup(self, *, master_addr: str, master_port: int, max_steps: int, weights: str = "load") -> dict[str, Any]:
        from vlmrun.policy.megatron import groups

        if weights not in ("load", "checkpoint"):
            raise ValueError(f"weights {weights!r}: 'load' or 'checkpoint'")
        self.device = rank_device(self.gpus)
        self._peak = StepPeak()
        if not dist.is_initialized():
            join_process_group(
                self.device,
                master_addr=master_addr,
                master_port=master_port,
                rank=self.rank,
                world_size=self.world_size,
            )
        self.groups = groups.initialize(self.ranks, seed=self.train.seed)
        self.max_steps = max_steps
        self._build(read=weights == "load")
        return {
            "rank": self.rank,
            "params": sum(p.numel() for p in self.params),
            "device": str(self.device),
            "layout": self.layout(),
            "load": self.weights_load,
        }

    def _build(self, *, read: bool) -> None:
        from vlmrun.policy.megatron.stage import build_stage

        rng.seed_all(self.train.seed + self.rank)
        self.built = build_stage(self.spec, self.opts, self.coords, self.device)
        self.stage = self.built.stage
        if read:
            self.weights_load = self.built.fill()
        else:
            self.weights_load = "from the checkpoint it resumed (the model's own weights not read)"
        self.stage.train()
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, self.train, self.max_steps)

    def load_model_weights(self) -> None:
        self.weights_load = self.built.fill()

    def layout(self) -> str:
        r = self.ranks
        extras = [
            w
            for w, on in (("sequence parallel", self.opts.sequence_parallel), ("recompute", self.opts.recompute))
            if on
        ]
        more = f" ({', '.join(extras)})" if extras else ""
        return f"megatron-core: {r.dp} replica(s) x tp={r.tp} x pp={r.pp}{more}"

    # ---- steps -----------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        from vlmrun.policy.megatron.grads import clip_and_norm, sync_gradients
        from vlmrun.policy.megatron.schedule import run_micro_batches

        t0 = time.perf_counter()
        self._peak.reset()
        loss = loss or NllLoss()
        (global_tokens,) = self.groups.replica_sum([float(sum(loss.tokens(b) for b in micro_batches))])
        denom = max(global_tokens, 1.0)
        for p in self.params:  # not the optimizer's zero_grad: a resume may still be restoring the optimizer
            p.grad = None
        stats, summed = LossStats(), [0.0]
        batches = [to_device(b, self.device) for b in micro_batches]

        def on_logprobs(k: int, logprobs: torch.Tensor) -> torch.Tensor:
            terms = loss(logprobs, batches[k])
            stats.add(terms)
            summed[0] += float(terms.total.detach())
            return terms.total / denom

        inputs, widths = self._inputs(batches)
        run_micro_batches(self.stage, inputs, widths, on_logprobs, forward_only=False)
        self._phase_done("forward_backward")
        sync_gradients(self.params, self.built.tied, self.groups.grads)
        norm = clip_and_norm(self.params, self.groups.grads, self.train.grad_clip, clip_gradients)
        self._phase_done("grad_norm_clip")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._phase_done("optimizer")
        total, reduced = self.groups.results(summed[0], stats)
        trim()  # the step's freed host memory back to the kernel (policy/host_memory.py)

        return StepResult(
            loss=total / denom,
            grad_norm=norm,
            lr=lr,
            valid_tokens=int(global_tokens),
            compute_s=time.perf_counter() - t0,
            peak_rss_mb=self._peak.peak_mb(),
            stats=reduced,
        )

    def _phase_done(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def _inputs(self, batches: list) -> tuple[list, list[int]]:
        multiple = self.ranks.tp if self.opts.sequence_parallel else 1
        shell = self.built.shell
        return [stage_inputs(b, shell, multiple=multiple, device=self.device) for b in batches], [
            b.input_ids.shape[1] for b in batches
        ]

    def _forward_logprobs(self, stage, batch) -> torch.Tensor:
        from vlmrun.policy.megatron.schedule import run_micro_batches

        b = to_device(batch, self.device)
        got: list[torch.Tensor] = []

        def keep(k: int, logprobs: torch.Tensor) -> None:
            got.append(logprobs.detach())

        inputs, widths = self._inputs([b])
        was_training = stage.training
        stage.eval()
        try:
            with torch.no_grad():
                run_micro_batches(stage, inputs, widths, keep, forward_only=True)
        finally:
            stage.train(was_training)
        shape = (b.input_ids.shape[0], b.input_ids.shape[1] - 1)
        return self.groups.from_last_stage(got[0] if got else None, shape, self.device).cpu()

    def logprobs(self, batch) -> torch.Tensor:
        return self._forward_logprobs(self.stage, batch)

    def reference_logprobs(self, batch) -> torch.Tensor:
        if getattr(self, "_reference", None) is None:
            from vlmrun.policy.megatron.stage import build_stage

            reference = build_stage(self.spec, self.opts, self.coords, self.device)
            reference.fill()
            reference.stage.requires_grad_(False)
            self._reference = reference.stage
        return self._forward_logprobs(self._reference, batch)

    # ---- checkpoints, refit, export -----------------------------------------------------------------
    def checkpoint_state(self) -> PolicyState:
        from vlmrun.policy.megatron.state import checkpoint_state

        return checkpoint_state(self)

    def load_checkpoint_state(self, state: PolicyState) -> None:
        from vlmrun.policy.megatron.state import load_checkpoint_state

        load_checkpoint_state(self, state)

    def weights_for_refit(
        self, *, dtype: str | None = None, bucket_bytes: int = REFIT_BUCKET_BYTES, into=None
    ) -> Iterator[dict[str, torch.Tensor]]:
        from vlmrun.policy.megatron.refit import refit_buckets

        return refit_buckets(self, dtype=dtype, bucket_bytes=bucket_bytes, into=into)

    @property
    def receives_refit(self) -> bool:
        """Whether this rank's refit buckets hold the weights: its replica's first rank (tp 0 of the first
        stage), where the replica's engine lives; the others' buckets are empty (refit.py)."""
        return self.coords.tp == 0 and self.coords.pp == 0

    def offload_to_host(self, parts: tuple[str, ...]) -> int:
        from vlmrun.policy.megatron.state import offload

        return offload(self, parts)

    def restore_from_host(self) -> int:
        host, self._host = getattr(self, "_host", None), None
        return host.restore() if host is not None else 0

    def export(self, read: Callable[[PolicyState], PolicyState], out: Path) -> None:
        from vlmrun.policy.megatron.state import export

        export(self.spec, read, out)

    def shutdown(self) -> None:
        from vlmrun.policy.megatron import groups

        for name in ("stage", "built", "_reference", "params", "optimizer", "scheduler"):
            self.__dict__.pop(name, None)
        groups.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def _dtype(name: str) -> torch.dtype:
    from vlmrun.config.dtype import torch_dtype

    return torch_dtype(name)
