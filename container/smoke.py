"""The image's GPU kernels, imported and (on a GPU) run once each against torch's reference, as JSON.

    python3 container/smoke.py [--require-gpu]     # in the image: docker run --gpus all, or srun --container-image

The build runs it without a GPU (docker build sees none): each kernel's extension module must import
against the installed torch (a kernel built for another torch fails here with an undefined symbol,
which transformers would hide by falling back to its slow path). On a GPU each kernel also runs on a
small input and is compared with the reference it replaces: flash-attention with SDPA, causal-conv1d
with a grouped conv1d, mamba-ssm's chunked scan with its own reference scan. Exit 0 when every kernel
imports (and, on a GPU, matches); 1 otherwise; `--require-gpu` also fails without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback

#: package -> its compiled extension modules (what a broken build fails to load)
KERNELS = {
    "flash_attn": ("flash_attn_2_cuda",),
    "causal_conv1d": ("causal_conv1d_cuda",),
    "mamba_ssm": ("selective_scan_cuda",),
}


def imported(package: str) -> dict:
    try:
        module = importlib.import_module(package)
        for ext in KERNELS[package]:
            importlib.import_module(ext)
    except Exception as e:  # noqa: BLE001 - the report says what failed
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    return {"ok": True, "version": getattr(module, "__version__", None)}


def run_flash_attn(torch) -> float:
    from flash_attn import flash_attn_func

    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = flash_attn_func(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    return float((got.float() - want.float()).abs().max())


def run_causal_conv1d(torch) -> float:
    from causal_conv1d import causal_conv1d_fn

    x = torch.randn(2, 64, 128, device="cuda")
    w, b = torch.randn(64, 4, device="cuda"), torch.randn(64, device="cuda")
    got = causal_conv1d_fn(x, w, b, activation="silu")
    ref = torch.nn.functional.conv1d(x, w.unsqueeze(1), b, padding=3, groups=64)[..., :128]
    return float((got - torch.nn.functional.silu(ref)).abs().max())


def run_mamba_ssm(torch) -> float:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref as reference

    g = torch.Generator(device="cuda").manual_seed(0)
    batch, length, heads, dim, state = 2, 128, 4, 32, 16
    x = torch.randn(batch, length, heads, dim, device="cuda", generator=g)
    dt = torch.rand(batch, length, heads, device="cuda", generator=g) * 0.1
    a = -torch.rand(heads, device="cuda", generator=g)
    b, c = (torch.randn(batch, length, 1, state, device="cuda", generator=g) for _ in range(2))
    got = mamba_chunk_scan_combined(x, dt, a, b, c, chunk_size=32)
    want = reference(x, dt, a, b, c, chunk_size=32)
    return float((got - want).abs().max())


RUNS = {"flash_attn": run_flash_attn, "causal_conv1d": run_causal_conv1d, "mamba_ssm": run_mamba_ssm}
TOLERANCE = {"flash_attn": 2e-2, "causal_conv1d": 1e-3, "mamba_ssm": 1e-2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--require-gpu", action="store_true", help="fail when no GPU is visible")
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu, "kernels": {}}
    for package in KERNELS:
        row = imported(package)
        if row["ok"] and gpu:
            try:
                row["max_abs_diff"] = RUNS[package](torch)
                row["ok"] = row["max_abs_diff"] <= TOLERANCE[package]
            except Exception:  # noqa: BLE001
                row |= {"ok": False, "error": traceback.format_exc()[-1500:]}
        report["kernels"][package] = row
    report["ok"] = all(r["ok"] for r in report["kernels"].values()) and (gpu or not args.require_gpu)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
