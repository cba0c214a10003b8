"""The `hf` policy backend: a transformers model replicated on every data-parallel rank, gloo on CPU.

Each rank holds the whole model, optimizer and LR schedule; gradients are summed across ranks in one
flat all-reduce (grad_sync.py), so every replica takes the same step and holds the same state (rank 0
alone saves it: `replicated_state`).
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
from vlmrun.policy.grad_sync import all_reduce_extreme, all_reduce_gradients, all_reduce_sum
from vlmrun.policy.interface import LossTerms, PolicyBackend, StepResult, TokenLoss
from vlmrun.policy.loss import NllLoss, token_logprobs


class HfPolicy(PolicyBackend):
    """Rank `rank` of `world_size`; `train` is the recipe's train section, `dtype` its model.dtype."""

    replicated_state = True

    def __init__(self, *, rank: int, world_size: int, model_dir: str, train, dtype: str = "float32"):
        self.rank, self.world_size = rank, world_size
        self.model_dir, self.train, self.dtype = model_dir, train, dtype

    def setup(self, *, master_addr: str, master_port: int, max_steps: int) -> dict[str, Any]:
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from vlmrun.policy.lr_schedule import lr_factor

        t = self.train
        if self.world_size > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(minutes=10),
            )
        rng.seed_all(t.seed + self.rank)
        dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if t.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(
                self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, foreach=False
            )
        else:
            self.optimizer = torch.optim.SGD(self.params, lr=t.lr, weight_decay=t.weight_decay, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(
                s, max_steps=max_steps, warmup_steps=t.warmup_steps, schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio
            ),
        )
        return {"rank": self.rank, "params": sum(p.numel() for p in self.params)}

    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        t0 = time.perf_counter()
        loss = loss or NllLoss()
        local_tokens = sum(loss.tokens(b) for b in micro_batches)
        (global_tokens,) = all_reduce_sum([float(local_tokens)])
        denom = max(global_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        local_loss, stats = 0.0, _StatsAccumulator()
        for b in micro_batches:
            out = self.model(**b.model_inputs(), use_cache=False)
            terms = loss(out.logits, b)
            (terms.total / denom).backward()
            local_loss += float(terms.total.detach())
            stats.add(terms)
        all_reduce_gradients(self.params)
        clip = self.train.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        (total_loss,) = all_reduce_sum([local_loss])
        return StepResult(
            loss=total_loss / denom,
            grad_norm=float(grad_norm),
            lr=lr,
            valid_tokens=int(global_tokens),
            compute_s=time.perf_counter() - t0,
            peak_rss_mb=peak_rss_mb(),
            stats=stats.reduced(),
        )

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            return token_logprobs(self.model(**batch.model_inputs(), use_cache=False).logits, batch.labels)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor:
        if getattr(self, "_reference", None) is None:
            from transformers import AutoModelForImageTextToText

            dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32
            self._reference = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype).eval()
            self._reference.requires_grad_(False)
        return token_logprobs(self._reference(**batch.model_inputs(), use_cache=False).logits, batch.labels)

    def score(self, loss_batches: list, prompt_batches: list, *, max_new_tokens: int = 4) -> list[float]:
        from vlmrun.policy.evaluate import score_batches

        return score_batches(self.model, self.tokenizer, loss_batches, prompt_batches, max_new_tokens=max_new_tokens)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"]["optimizer"])
        self.scheduler.load_state_dict(state["optimizer"]["scheduler"])

    def weights_for_refit(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.state_dict().items()}

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
