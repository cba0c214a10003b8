"""Training steps of the 3B-sized model through vlmrun's policy, timed: tokens/s, phases, peak memory, MFU.

The step is the policy's own `train_step` (workload.open_check_policy: FSDP2 on one rank, bf16 mixed
precision over fp32 master weights): the NLL summed over labelled tokens and divided by the step's
global count of them, the gradient sync schedule, norm and clipping, AdamW (fused on a GPU) and the LR
schedule, exactly as a training rank takes it. The policy reports the end of each phase
(`PolicyBackend.on_phase`); the clock synchronizes the device there, so asynchronous CUDA work is
charged to the phase that queued it. MFU is reported for the whole step and for forward + backward.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import workload
from probes import significant

from vlmrun.models.build import build_model
from vlmrun.models.spec import ModelSpec

log = logging.getLogger("gpu_check.train")
MFU_GOAL = 0.40  # of the measured matmul ceiling, for the 3B-sized config (issue 12)


class PhaseClock:
    """Seconds per phase of the step in flight; `mark(name)` closes the phase that ran since the last mark
    (after synchronizing `device`). `start()` opens a step."""

    def __init__(self, device: str):
        self.device = device
        self.phases: dict[str, float] = {}
        self._last = 0.0

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.phases = {}
        self._last = self._now()

    def mark(self, name: str) -> None:
        now = self._now()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Achieved FLOPs per second over `peak_tflops`, or None without a peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return round(flops / seconds / (peak_tflops * 1e12), 4)


def fsdp_throughput(scale: workload.Scale, *, ceiling_tflops: float | None, spec_tflops: float | None) -> dict:
    """Warm-up steps, then `scale.steps` timed steps of the policy; medians over the timed steps."""
    config = workload.model_config(scale.train_overrides)
    batch = workload.synthetic_batch(config, seq_len=scale.seq_len, image_side=scale.image_side, seed=1)
    probe = build_model(ModelSpec(config=config), on_meta=True)  # the architecture, for counting only
    flops = workload.training_flops(probe, batch)
    attention = getattr(probe.config, "_attn_implementation", None)
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    policy = workload.open_check_policy(config, scale, seed=0, activation_checkpointing=scale.activation_checkpointing)
    try:
        results, clocks = run_steps(policy, batch, scale)
    finally:
        policy.shutdown()
    phases = {name: statistics.median(c[name] for c in clocks) for name in clocks[0]}
    step_s = statistics.median(sum(c.values()) for c in clocks)
    tokens = batch.input_ids.numel()
    report = {
        "step": "vlmrun.policy.open_policy('hf') train_step: FSDP2, one rank",
        "loss": "NLL summed over labelled tokens / the step's global valid tokens",
        "model_params": n_params,
        "tokens_per_step": tokens,
        "valid_tokens_per_step": results[0].valid_tokens,
        "image_patches_per_step": batch.media["pixel_values"].shape[0],
        "attn_implementation": attention,
        "activation_checkpointing": scale.activation_checkpointing,
        "mixed_precision": "bf16 params and compute, fp32 master weights and gradient reduction",
        "optimizer": f"{workload.TRAIN.optimizer} (the policy's: fused on a GPU, foreach=False on a CPU), grad_clip {workload.TRAIN.grad_clip}",
        "warmup_steps": scale.warmup_steps,
        "timed_steps": scale.steps,
        "losses": [round(r.loss, 4) for r in results],
        "grad_norms": [significant(r.grad_norm) for r in results],
        "step_s": round(step_s, 4),
        "phases_s": _rounded(phases),
        "tokens_per_s": round(tokens / step_s, 1),
        "flops_per_step": flops,
        "flops_formula": "see tools/gpu/workload.py: 6*matmul_weights*rows + 12*layers*heads*head_dim*S*context",
    }
    return report | _mfu_report(flops["total"], step_s, phases["forward_backward"], ceiling_tflops, spec_tflops)


def run_steps(policy, batch, scale: workload.Scale) -> tuple[list, list[dict]]:
    """Warm-up plus timed steps from a reset peak-memory counter; (every StepResult, the timed steps'
    phases). Raises RuntimeError on a non-finite loss."""
    if scale.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = PhaseClock(scale.device)
    policy.on_phase = clock.mark
    results, clocks = [], []
    for step in range(scale.warmup_steps + scale.steps):
        clock.start()
        result = policy.train_step([batch])
        log.info("step %d: loss %.4f, grad norm %.3f, %s", step, result.loss, result.grad_norm, _rounded(clock.phases))
        results.append(result)
        if step >= scale.warmup_steps:
            clocks.append(dict(clock.phases))
    if not all(math.isfinite(r.loss) for r in results):
        raise RuntimeError(f"non-finite loss: {[r.loss for r in results]}")
    return results, clocks


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
