"""The policy's optimizer and LR schedule (`train.optimizer`, `train.lr_schedule`), and the state a
checkpoint fills on a resume.

A resume of a sharded policy hands DCP the optimizer's state as the tensors to load into, so they must
exist before the first step. torch's `get_state_dict` makes them by running one optimizer step with zero
gradients and a zero LR: a whole gradient allocated, and AdamW's arithmetic over every parameter, only
for values the load overwrites (most of a resume's read time on CPU: tools/bench_load.py measures it),
and a step count of 1 left behind when no load follows. `allocate_state` gives
AdamW the same tensors (same keys, dtypes and placements; tests/test_fsdp_policy.py compares them with
torch's) as zeros with a step count of 0, without the step: what a fresh AdamW's first step starts from,
so the optimizer takes the same steps whether a load follows or not. SGD without momentum keeps no state
and needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlmrun.policy.lr_schedule import lr_factor

if TYPE_CHECKING:  # tools/gpu/check.py runs the policy where pydantic is not installed
    from vlmrun.config.train import TrainConfig


def build_optimizer(params, train: TrainConfig, max_steps: int, *, fused: bool = False):
    """(optimizer, LR scheduler) for `params` as `train` asks. A CPU rank's optimizer takes torch's
    per-tensor loop (`foreach=False`), whose order the bitwise checks rely on; a GPU rank's (`fused`)
    its multi-tensor kernels, on the GPU or, with parallel.cpu_offload, on the host's threads: AdamW's
    fused kernel, SGD's foreach one (torch has no DTensor rule for SGD's fused kernel)."""
    if train.optimizer == "adamw":
        kernel = {"fused": True} if fused else {"foreach": False}
        optimizer = torch.optim.AdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, **kernel)
    else:
        optimizer = torch.optim.SGD(params, lr=train.lr, weight_decay=train.weight_decay, foreach=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s,
            max_steps=max_steps,
            warmup_steps=train.warmup_steps,
            schedule=train.lr_schedule,
            min_lr_ratio=train.min_lr_ratio,
        ),
    )
    return optimizer, scheduler


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter of an AdamW `optimizer` that has no state yet the state a fresh
    AdamW starts its first step from (zero moments, step 0; module doc); other optimizers are left alone."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group["capturable"] or group["fused"]
        for p in group["params"]:
            if not p.requires_grad or p in optimizer.state:
                continue
            state = {"step": torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")}
            for key in ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group["amsgrad"] else ())):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
