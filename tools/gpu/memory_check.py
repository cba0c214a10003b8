"""The memory-fit estimate (vlmrun/models/memory.py, what `vlmrun submit` checks) against the peak of
the policy's own training step on the GPU.

Each case opens the policy as a GPU recipe runs it (workload.open_check_policy: the 3B architecture,
random init, FSDP2 on one rank, fp32 master weights, bf16 mixed precision), takes one `train_step` of
`micro_batches` micro-batches of `sequences` x `seq_len` tokens with one 448 px image each (AdamW
allocates its state), then a second one from a reset peak counter: torch.cuda.max_memory_allocated of
that step against the estimate of the same shape without its fixed overhead (the CUDA context is not
an allocation), with max_memory_reserved beside it. A case that runs out of memory says so and the
next one runs. On --cpu-smoke one tiny case runs the same code and no peak is read.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import workload

from vlmrun.models.memory import TrainingShape, estimate_memory
from vlmrun.models.params import count_architecture

# the 1n2g Qwen recipe's micro-batch (4 x 2048 tokens, 448 px) with and without activation checkpointing and
# gradient accumulation, and the same tokens as 8 shorter sequences (attention's seq_len^2 term, if any)
GPU_CASES = [
    {"checkpointing": True, "sequences": 4, "seq_len": 2048},
    {"checkpointing": True, "sequences": 4, "seq_len": 2048, "micro_batches": 2},
    {"checkpointing": False, "sequences": 4, "seq_len": 2048},
    {"checkpointing": False, "sequences": 4, "seq_len": 2048, "fused_attention_only": True},
    {"checkpointing": False, "sequences": 8, "seq_len": 1024},
]
CPU_SMOKE_CASES = [{"checkpointing": True, "sequences": 2, "seq_len": 64, "micro_batches": 2}]


def attention_kernels(fused_only: bool):
    """SDPA restricted to the fused kernels (flash, memory-efficient: no seq_len^2 scores), or as is."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not fused_only:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def memory_fit(scale: workload.Scale) -> dict:
    """Every case of the scale's mode, one after the other (each on a freshly emptied device)."""
    cases = GPU_CASES if scale.device == "cuda" else CPU_SMOKE_CASES
    rows = []
    for case in cases:
        gc.collect()  # FSDP's hooks hold the last case's model in reference cycles
        if scale.device == "cuda":
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if scale.device == "cuda" else None
        rows.append(measure_case(scale, **case) | {"allocated_before_case": before})
    return {"rows": rows, "step": "the policy's train_step (workload.open_check_policy), second step of each case"}


def measure_case(
    scale: workload.Scale,
    *,
    checkpointing: bool,
    sequences: int,
    seq_len: int,
    micro_batches: int = 1,
    fused_attention_only: bool = False,
) -> dict:
    """The peak allocation of the policy's second step against the estimate of the same shape."""
    config = workload.model_config(scale.train_overrides)
    image = scale.image_side
    batch = workload.synthetic_batch(config, seq_len=seq_len, image_side=image, seed=5, sequences=sequences)
    shape = TrainingShape(
        micro_batches=micro_batches,
        fsdp=True,
        mixed_precision="bf16",
        activation_checkpointing=checkpointing,
        sequences=sequences,
        seq_len=seq_len,
        image_size=image,
    )
    estimate = estimate_memory(count_architecture("qwen2_5_vl", config), shape)
    row = {"activation_checkpointing": checkpointing, "micro_batches": micro_batches, "sequences": sequences}
    row |= {"seq_len": seq_len, "fused_attention_only": fused_attention_only}
    row |= {
        "estimate_bytes": estimate.device_total,
        "estimate_without_overhead": estimate.device_total - estimate.overhead,
    }
    row["estimate_terms"] = {k: v for k, v in estimate.to_json().items() if type(v) is int}
    policy = workload.open_check_policy(config, scale, seed=0, activation_checkpointing=checkpointing)
    try:
        with attention_kernels(fused_attention_only):
            policy.train_step([batch] * micro_batches)
            if scale.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            result = policy.train_step([batch] * micro_batches)
            if scale.device == "cuda":
                torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        return row | {"failed": str(e).splitlines()[0][:300]}
    finally:
        policy.shutdown()
    row["loss"] = round(result.loss, 4)
    if scale.device != "cuda":
        return row | {"allocated_peak": None, "note": "CPU run: no CUDA allocator to read"}
    row |= {"allocated_peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()}
    row["ratio_estimate_to_allocated"] = round(row["estimate_without_overhead"] / row["allocated_peak"], 3)
    return row
