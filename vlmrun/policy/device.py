"""Where a rank computes: its GPU when it has one, else the CPU; the CUDA allocator's setting every GPU
rank runs with; and moving micro-batches there."""

from __future__ import annotations

import dataclasses
import os

import torch

#: Growable segments: the blocks the phases of a step (training, refit, rollout, validation) free are
#: reused across sizes instead of stranded (the H200 check measured 20-22 GiB of allocator slack
#: without). A user's own PYTORCH_CUDA_ALLOC_CONF wins.
CUDA_ALLOC_CONF = "expandable_segments:True"
#: Minutes a collective waits for its slowest rank before the group fails: on a GPU the ranks may wait
#: out one rank's checkpoint write of its shard of a 30B model (tens of GB) on a slow file system.
COLLECTIVE_TIMEOUT_MIN = {"cpu": 10, "cuda": 60}


def prepare_cuda_allocator() -> None:
    """Give this process CUDA_ALLOC_CONF unless its environment has a setting; call it before the first
    CUDA allocation (the allocator reads the variable once, then)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def rank_device(gpus: bool) -> torch.device:
    """`cuda:0` (Ray gives each rank one GPU through CUDA_VISIBLE_DEVICES) when `gpus`, else the CPU.
    Raises RuntimeError when the recipe asks for GPUs on a node where torch sees none."""
    if not gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            "cluster.gpus_per_node > 0 but torch sees no CUDA device on this node "
            f"(CUDA_VISIBLE_DEVICES={visible!r}, torch {torch.__version__})"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def to_device(value, device: torch.device):
    """`value` (a tensor, or a dataclass, dict, list or tuple holding tensors) with every tensor on
    `device`; the same object when the device is the CPU, so CPU runs copy nothing."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def join_process_group(device: torch.device, *, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
    """This rank into the job's default process group: gloo on a CPU rank; on a GPU, NCCL for the device's
    tensors and gloo for the host's. A collective waits COLLECTIVE_TIMEOUT_MIN for its slowest rank."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=COLLECTIVE_TIMEOUT_MIN[device.type]),
    )
