"""One FSDP2 training step of the 3B-sized model, timed: tokens/s, peak memory and MFU.

The step is the one vlmrun's FSDP path takes: bf16 mixed precision over fp32 master weights
(`Sharding(mixed_precision="bf16")`), loss over the labelled tokens, `grad_norm` (on a GPU mesh an
fp64 sum of squares of the gradient shards, on the device) and `clip_gradients` from
`vlmrun.policy.fsdp`, then AdamW. Each phase is timed on its own (the device is synchronized at each boundary), so a slow gradient norm shows up as such;
MFU is reported for the whole step and for forward + backward alone.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import workload
from probes import significant

from vlmrun.policy.fsdp import Sharding, clip_gradients, grad_norm, shard_model

log = logging.getLogger("gpu_check.train")
MAX_GRAD_NORM = 1.0
MFU_GOAL = 0.40  # of the measured matmul ceiling, for the 3B-sized config (issue 12)


class PhaseClock:
    """Seconds per named phase of one step; `mark(name)` closes the phase that ran since the last mark
    (after synchronizing `device`, so asynchronous CUDA work is charged to the phase that queued it)."""

    def __init__(self, device: str):
        self.device = device
        self.phases: dict[str, float] = {}
        self._last = self._now()

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, name: str) -> None:
        now = self._now()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def train_step(model, optimizer, params, batch: dict, clock: PhaseClock) -> tuple[float, float]:
    """One optimizer step over `batch` (mean loss over its labelled tokens); returns (loss, grad norm)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    clock.mark("forward_backward")
    norm = grad_norm(params, sharded=True)
    clip_gradients(params, norm, MAX_GRAD_NORM)
    clock.mark("grad_norm_clip")
    optimizer.step()
    clock.mark("optimizer")
    return float(loss.detach()), norm


def sharded_model(config, mesh, *, device: str, seed: int, activation_checkpointing: bool = False):
    """(model, params, optimizer): a random-init fp32 model of `config` sharded with bf16 mixed precision,
    and AdamW over its parameters (foreach on CUDA, per-parameter on CPU as the hf backend does)."""
    model = workload.build_model(config, device=device, seed=seed)
    model.train()
    sharding = Sharding(mixed_precision="bf16", activation_checkpointing=activation_checkpointing)
    shard_model(model, mesh, sharding)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, foreach=device == "cuda")
    return model, params, optimizer


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Achieved FLOPs per second over `peak_tflops`, or None without a peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return round(flops / seconds / (peak_tflops * 1e12), 4)


def fsdp_throughput(scale: workload.Scale, mesh, *, ceiling_tflops: float | None, spec_tflops: float | None) -> dict:
    """Warm-up steps, then `scale.steps` timed steps of the training model; medians over the timed steps."""
    config = workload.build_config(scale.train_overrides)
    probe = workload.build_model(config, device="meta", seed=0)
    batch = workload.synthetic_batch(config, seq_len=scale.seq_len, image_side=scale.image_side, device="cpu", seed=1)
    flops = workload.training_flops(probe, config, batch)
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    model, params, optimizer = sharded_model(
        config, mesh, device=scale.device, seed=0, activation_checkpointing=scale.activation_checkpointing
    )
    batch = {k: v.to(scale.device) for k, v in batch.items()}
    losses, clocks = run_steps(model, optimizer, params, batch, scale)
    phases = {name: statistics.median(c[name] for c in clocks) for name in clocks[0]}
    step_s = statistics.median(sum(c.values()) for c in clocks)
    tokens = batch["input_ids"].numel()
    report = {
        "model_params": n_params,
        "tokens_per_step": tokens,
        "image_patches_per_step": batch["pixel_values"].shape[0],
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "activation_checkpointing": scale.activation_checkpointing,
        "mixed_precision": "bf16 params and compute, fp32 master weights and gradient reduction",
        "optimizer": f"AdamW(foreach={scale.device == 'cuda'})",
        "warmup_steps": scale.warmup_steps,
        "timed_steps": scale.steps,
        "losses": [round(x, 4) for x in losses],
        "step_s": round(step_s, 4),
        "phases_s": _rounded(phases),
        "tokens_per_s": round(tokens / step_s, 1),
        "flops_per_step": flops,
        "flops_formula": "see tools/gpu/workload.py: 6*matmul_weights*rows + 12*layers*heads*head_dim*S*context",
    }
    return report | _mfu_report(flops["total"], step_s, phases["forward_backward"], ceiling_tflops, spec_tflops)


def run_steps(model, optimizer, params, batch: dict, scale: workload.Scale) -> tuple[list[float], list[dict]]:
    """Warm-up plus timed steps from a reset peak-memory counter; (every loss, the timed steps' phases).
    Raises RuntimeError on a non-finite loss."""
    if scale.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, clocks = [], []
    for step in range(scale.warmup_steps + scale.steps):
        clock = PhaseClock(scale.device)
        loss, norm = train_step(model, optimizer, params, batch, clock)
        log.info("step %d: loss %.4f, grad norm %.3f, %s", step, loss, norm, _rounded(clock.phases))
        losses.append(loss)
        if step >= scale.warmup_steps:
            clocks.append(clock.phases)
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    return losses, clocks


def _mfu_report(flops: float, step_s: float, fwd_bwd_s: float, ceiling: float | None, spec: float | None) -> dict:
    memory = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return {
        "achieved_tflops": significant(flops / step_s / 1e12),
        "mfu_vs_spec": mfu(flops, step_s, spec),
        "mfu_vs_ceiling": mfu(flops, step_s, ceiling),
        "forward_backward_mfu_vs_spec": mfu(flops, fwd_bwd_s, spec),
        "forward_backward_mfu_vs_ceiling": mfu(flops, fwd_bwd_s, ceiling),
        "mfu_goal_vs_ceiling": MFU_GOAL,
        "mfu_goal_met": _at_least(mfu(flops, step_s, ceiling), MFU_GOAL),
        "forward_backward_mfu_goal_met": _at_least(mfu(flops, fwd_bwd_s, ceiling), MFU_GOAL),
        "peak_memory_gib": memory,
        "peak_memory_note": None if memory is not None else "CPU run: torch.cuda.max_memory_allocated unavailable",
    }


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in phases.items()}
