"""The machine: CUDA and NCCL visibility, the 1-rank process group, FSDP2's API and the bf16 matmul ceiling."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

# Dense (no sparsity) bf16 tensor-core peaks from the vendor datasheets, TFLOPS; the first name that is a
# substring of torch.cuda.get_device_name() wins, so the more specific names come first.
SPEC_BF16_DENSE_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("B200", 2250.0),
    ("L40S", 362.0),
)
# Every FSDPModule setter vlmrun.policy.fsdp calls (set_reduce_scatter_unused_params only matters, and
# is only required, with more than one rank).
FSDP_SETTERS = (
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params",
    "set_requires_gradient_sync",
)


def spec_peak_tflops(device_name: str | None) -> float | None:
    """The datasheet dense bf16 peak of `device_name`, or None for a device not in the table."""
    for name, tflops in SPEC_BF16_DENSE_TFLOPS:
        if device_name and name in device_name:
            return tflops
    return None


def fsdp_api() -> dict[str, bool]:
    """Which of the FSDP2 setters vlmrun.policy.fsdp calls this torch has."""
    from torch.distributed.fsdp import FSDPModule

    return {name: hasattr(FSDPModule, name) for name in FSDP_SETTERS}


@contextlib.contextmanager
def process_group(device: str, backend: str) -> Iterator[object]:
    """A 1-rank process group over a FileStore in a fresh temporary folder (no port to collide on), and
    its 1-D device mesh; the group is destroyed on exit."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="vlmrun-gpu-check-") as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(minutes=5))
        try:
            yield init_device_mesh(device, (1,))
        finally:
            dist.destroy_process_group()


def nccl_version() -> str | None:
    """NCCL's version as "major.minor.patch", or None when this torch has no NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, int):  # old torch: 21803 means 2.18.3
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(v) for v in version)


def device_report(device: str) -> dict:
    """CUDA and NCCL as torch sees them, and whether a 1-rank all_reduce on `device` gives the right sum
    (the process group must be up)."""
    report = {
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "nccl": nccl_version() if torch.cuda.is_available() else None,
        "backend": str(dist.get_backend()),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        report |= {
            "device_name": props.name,
            "device_count": torch.cuda.device_count(),
            "capability": ".".join(str(v) for v in torch.cuda.get_device_capability(0)),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
    else:
        report |= {"device_name": None, "skipped": "--cpu-smoke: no CUDA device numbers"}
    values = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(values)
    report["all_reduce_ok"] = values.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    if not report["all_reduce_ok"]:
        raise RuntimeError(f"1-rank all_reduce returned {values.cpu().tolist()}, expected [0, 1, 2, 3]")
    return report


def timed(fn, device: str) -> float:
    """Seconds `fn()` takes on `device`: CUDA events around it, or the wall clock on CPU."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


def matmul_tflops(n: int, device: str, *, repeats: int = 5, inner: int = 10) -> float:
    """The best of `repeats` timings of `inner` back-to-back bf16 n x n x n matmuls, in TFLOPS."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(a)

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b, out=out)

    run()  # warm-up: cuBLAS picks its kernel, the clocks ramp up
    best = min(timed(run, device) for _ in range(repeats))
    return 2.0 * n**3 * inner / best / 1e12


def significant(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant digits (a CPU's TFLOPS would round to 0.0 at fixed decimals)."""
    return float(f"{x:.{digits}g}")


def matmul_ceiling(device: str, sizes: tuple[int, ...]) -> dict:
    """The bf16 matmul ceiling: the best TFLOPS over square matmuls of `sizes`, with the datasheet peak."""
    by_size = {str(n): significant(matmul_tflops(n, device)) for n in sizes}
    name = torch.cuda.get_device_name(0) if device == "cuda" else None
    spec = spec_peak_tflops(name)
    ceiling = max(by_size.values())
    return {
        "dtype": "bfloat16",
        "tflops_by_size": by_size,
        "ceiling_tflops": ceiling,
        "spec_tflops": spec,
        "spec_source": "datasheet dense bf16" if spec else f"no datasheet peak for {name or device!r}",
        "ceiling_over_spec": round(ceiling / spec, 3) if spec else None,
    }
