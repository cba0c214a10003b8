"""The `hf` policy backend: a transformers model on every data-parallel rank, on CPU (gloo) or GPU (NCCL).

Two layouts (`parallel.fsdp`), one set of numbers:

1. Replicated: each rank holds the whole model, optimizer and LR schedule; gradients are summed across
   ranks in one flat all-reduce (grad_sync.py), so every replica takes the same step and holds the
   same state (rank 0 alone saves it).
2. Sharded (FSDP2, fsdp.py): each rank holds 1/dp of parameters, gradients and optimizer state;
   gradients are reduce-scattered once per step (the last micro-batch) as a sum; every rank saves its
   own shard (`sharded_state`). On CPU with dp=2 both layouts give bitwise-equal losses, gradient
   norms and parameters (tests/test_fsdp_policy.py).

The device is the rank's GPU when the recipe's cluster has GPUs (Ray sets CUDA_VISIBLE_DEVICES to the
rank's bundle, so it is `cuda:0`), else the CPU. Micro-batches arrive on the CPU and are moved here.
"""

from __future__ import annotations

import os
import resource
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlmrun.policy import rng
from vlmrun.policy.device import rank_device, to_device
from vlmrun.policy.fsdp import (
    Sharding,
    checkpoint_layers,
    clip_gradients,
    decoder_layers,
    grad_norm,
    set_gradient_sync,
    shard_model,
    touch_towers,
    unsharded,
)
from vlmrun.policy.grad_sync import all_reduce_extreme, all_reduce_gradients, all_reduce_sum
from vlmrun.policy.interface import LossTerms, PolicyBackend, StepResult, TokenLoss
from vlmrun.policy.loss import NllLoss, token_logprobs


class HfPolicy(PolicyBackend):
    """Rank `rank` of `world_size`; `train` is the recipe's train section, `dtype` its model.dtype,
    `parallel` its parallel section (None: replicated, no options), `gpus` whether ranks own a GPU."""

    def __init__(
        self, *, rank: int, world_size: int, model_dir: str, train, dtype: str = "float32", parallel=None, gpus=False
    ):
        self.rank, self.world_size = rank, world_size
        self.model_dir, self.train, self.dtype = model_dir, train, dtype
        self.sharded_state = bool(parallel is not None and parallel.fsdp)
        self.sharding = Sharding(
            mixed_precision=getattr(parallel, "mixed_precision", "none"),
            activation_checkpointing=getattr(parallel, "activation_checkpointing", False),
            cpu_offload=getattr(parallel, "cpu_offload", False),
        )
        self.sync_every = bool(getattr(parallel, "reduce_every_micro_batch", False))
        self.gpus = gpus

    @classmethod
    def from_recipe(cls, recipe, *, rank: int, world_size: int, model_dir: str) -> HfPolicy:
        return cls(
            rank=rank,
            world_size=world_size,
            model_dir=model_dir,
            train=recipe.train,
            dtype=recipe.model.dtype,
            parallel=recipe.parallel,
            gpus=recipe.cluster.gpus_per_node > 0,
        )

    def setup(self, *, master_addr: str, master_port: int, max_steps: int) -> dict[str, Any]:
        t = self.train
        self.device = rank_device(self.gpus)
        if self.world_size > 1 or self.sharded_state:
            dist.init_process_group(
                "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(minutes=10),
            )
        rng.seed_all(t.seed + self.rank)
        self.model = self._build_model()
        self.model.train()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = self._build_optimizer(max_steps)
        return {"rank": self.rank, "params": sum(p.numel() for p in self.params), "device": str(self.device)}

    def _build_model(self, *, trainable: bool = True) -> torch.nn.Module:
        """The model directory's model on this rank's device, sharded when `parallel.fsdp`."""
        from transformers import AutoModelForImageTextToText

        dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype)
        if not trainable:
            model.requires_grad_(False)
        if self.sharded_state:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            frozen = Sharding(mixed_precision=self.sharding.mixed_precision, cpu_offload=self.sharding.cpu_offload)
            return shard_model(model, mesh, self.sharding if trainable else frozen)
        if self.sharding.activation_checkpointing and trainable:
            checkpoint_layers(model, decoder_layers(model))
        return model.to(self.device)

    def _build_optimizer(self, max_steps: int):
        from vlmrun.policy.lr_schedule import lr_factor

        t = self.train
        if t.optimizer == "adamw":
            optimizer = torch.optim.AdamW(
                self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, foreach=False
            )
        else:
            optimizer = torch.optim.SGD(self.params, lr=t.lr, weight_decay=t.weight_decay, foreach=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(
                s, max_steps=max_steps, warmup_steps=t.warmup_steps, schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio
            ),
        )
        return optimizer, scheduler

    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        t0 = time.perf_counter()
        loss = loss or NllLoss()
        local_tokens = sum(loss.tokens(b) for b in micro_batches)
        (global_tokens,) = all_reduce_sum([float(local_tokens)])
        denom = max(global_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        local_loss, stats = 0.0, _StatsAccumulator()
        for k, b in enumerate(micro_batches):
            if self.sharded_state:  # reduce-scatter once, after the step's last micro-batch (or after each)
                set_gradient_sync(self.model, self.sync_every or k == len(micro_batches) - 1)
            b = to_device(b, self.device)
            out = self.model(**self._inputs(b), use_cache=False)
            terms = loss(out.logits, b)
            total = touch_towers(self.model, terms.total) if self.sharded_state else terms.total
            (total / denom).backward()
            local_loss += float(terms.total.detach())
            stats.add(terms)
        if not self.sharded_state:
            all_reduce_gradients(self.params)
        norm = grad_norm(self.params, sharded=self.sharded_state)
        clip_gradients(self.params, norm, self.train.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        (total_loss,) = all_reduce_sum([local_loss])
        return StepResult(
            loss=total_loss / denom,
            grad_norm=norm,
            lr=lr,
            valid_tokens=int(global_tokens),
            compute_s=time.perf_counter() - t0,
            peak_rss_mb=peak_rss_mb(),
            stats=stats.reduced(),
        )

    def _inputs(self, batch) -> dict[str, torch.Tensor]:
        """The micro-batch's model inputs, floating ones (pixels) in the compute dtype under mixed
        precision (some towers multiply their input with their weights without casting it)."""
        inputs = batch.model_inputs()
        if self.sharding.mixed_precision != "bf16":
            return inputs
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            b = to_device(batch, self.device)
            return token_logprobs(self.model(**self._inputs(b), use_cache=False).logits, b.labels).cpu()
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor:
        if getattr(self, "_reference", None) is None:
            self._reference = self._build_model(trainable=False).eval()
        b = to_device(batch, self.device)
        return token_logprobs(self._reference(**self._inputs(b), use_cache=False).logits, b.labels).cpu()

    def score(self, loss_batches: list, prompt_batches: list, *, max_new_tokens: int = 4) -> list[float]:
        """Validation on this rank's share; a sharded model is gathered whole for it (ranks may hold
        different numbers of batches, and generation calls the vision tower outside `forward`)."""
        from vlmrun.policy.evaluate import score_batches

        with unsharded(self.model):
            return score_batches(
                self.model,
                self.tokenizer,
                [to_device(b, self.device) for b in loss_batches],
                [to_device(b, self.device) for b in prompt_batches],
                max_new_tokens=max_new_tokens,
            )

    def state_dict(self) -> dict[str, Any]:
        if self.sharded_state:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optimizer = get_state_dict(self.model, self.optimizer)
            return {"model": model, "optimizer": {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}}
        return {
            "model": self.model.state_dict(),
            "optimizer": {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded_state:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"]["optimizer"],
            )
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"]["optimizer"])
        self.scheduler.load_state_dict(state["optimizer"]["scheduler"])

    def weights_for_refit(self) -> dict[str, torch.Tensor]:
        """Full weights by HF name, on the CPU; gathered from every rank's shard when sharded
        (collective: every rank calls it)."""
        if self.sharded_state:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            return {name: t.detach().cpu() for name, t in full.items()}
        return {name: p.detach().cpu() for name, p in self.model.state_dict().items()}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _StatsAccumulator:
    """A loss's statistics over this rank's micro-batches, then over all ranks (`LossTerms`)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, terms: LossTerms) -> None:
        for k, v in terms.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in terms.mins.items():
            self.mins[k] = min(self.mins.get(k, float("inf")), v)
        for k, v in terms.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, float("-inf")), v)

    def reduced(self) -> dict[str, float]:
        """Every statistic over all ranks; the same keys on every rank (collectives in sorted key order)."""
        out: dict[str, float] = {}
        for values, reduce in (
            (self.sums, all_reduce_sum),
            (self.mins, lambda v: all_reduce_extreme(v, largest=False)),
            (self.maxs, lambda v: all_reduce_extreme(v, largest=True)),
        ):
            keys = sorted(values)
            if keys:
                out |= dict(zip(keys, reduce([values[k] for k in keys]), strict=True))
        return out


def peak_rss_mb() -> float:
    """Peak RSS of this process and its loader worker children, in MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024.0, 1) if os.name == "posix" else 0.0
