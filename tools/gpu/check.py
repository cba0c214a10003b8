"""GPU check: one JSON that says whether this machine runs vlmrun's FSDP2 training path, and how fast.

    python tools/gpu/check.py --out $OUT/gpu_check.json              # one GPU, a few minutes
    python tools/gpu/check.py --cpu-smoke --out /tmp/gpu_check.json  # every section on CPU, seconds (CI)

Sections, in order; each is {"ok": true, "seconds": ..., ...} or {"ok": false, "error": ..., "traceback":
...}, and a failed one does not stop the others:
  cuda            CUDA and NCCL as torch sees them, and a 1-rank all_reduce
  matmul_ceiling  the best bf16 TFLOPS of square matmuls (CUDA events), and the datasheet peak
  fsdp_train      the policy's train_step on a random-init Qwen2.5-VL-3B-sized model, one 448 px image plus
                  text: tokens/s, phase times, peak memory, MFU against the datasheet peak and the ceiling
  dcp_resume      a checkpoint of a cut-down model (2 layers) through the checkpoint store; a fresh policy
                  that loads it takes the next step bitwise equal
  logprob_error   bf16 against fp32 token_mult_prob_error of the policy's logprobs of the 3B-sized model
  memory_fit      the memory-fit estimate against the peak of the policy's step, for the GPU recipes' shapes

Every section past the first two runs vlmrun's own code: the `hf` policy from `vlmrun.policy.open_policy`
(a `ModelSpec` of the config: random init on the meta device, FSDP2 on one rank), its `train_step`,
`logprobs` and checkpoint state, and `vlmrun.checkpoint.store.CheckpointStore`. What that
imports is the standard library, torch, numpy and transformers: no pydantic, no Ray, no network, no
install. vlmrun comes from the repository: on a machine where it is not installed run the check from
the repository root as `PYTHONPATH=. python tools/gpu/check.py`. No weights are downloaded. Each policy
joins a 1-rank process group (NCCL on CUDA, gloo for --cpu-smoke) on a free loopback port; the cuda
section's all_reduce uses a FileStore. The JSON goes to stdout, and to --out or, when $OUT is set, to
$OUT/gpu_check.json. Exit status: 0 when every section is ok, 1 otherwise, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers imports huggingface_hub
# cuBLAS is deterministic only with a fixed workspace (dcp_resume); 8 x 4 MiB is torch's Hopper default size
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# the 3B step holds ~100 GiB at its peak: growable segments keep fragmentation from turning it into an OOM
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import dcp_check
import logprob_check
import memory_check
import probes
import report as report_file
import torch
import train_check
import workload

log = logging.getLogger("gpu_check")
SECTIONS = ("cuda", "matmul_ceiling", "fsdp_train", "dcp_resume", "logprob_error", "memory_fit")
GPU_DEFAULTS = {"steps": 4, "warmup": 1, "seq_len": 4096}
CPU_SMOKE_DEFAULTS = {"steps": 2, "warmup": 1, "seq_len": 64}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; unset sizes take the defaults of the mode (GPU_DEFAULTS or CPU_SMOKE_DEFAULTS)."""
    parser = argparse.ArgumentParser(
        prog="tools/gpu/check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="every section on CPU with a tiny model (CI)")
    parser.add_argument("--out", type=Path, help="also write the JSON here (default: $OUT/gpu_check.json if set)")
    parser.add_argument("--steps", type=int, help="timed training steps (GPU 4, smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed training steps first (GPU 1, smoke 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per training sequence (GPU 4096, smoke 64)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset to run")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute decoder layers")
    args = parser.parse_args(argv)
    defaults = CPU_SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; allowed: {', '.join(SECTIONS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args


def environment(setters: dict[str, bool]) -> dict:
    """Versions and the FSDP2 setters torch has."""
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "fsdp_setters": setters,
    }


def run_section(name: str, fn, device: str) -> dict:
    """`fn()`'s report with "ok" and "seconds"; an exception becomes {"ok": false, "error", "traceback"}."""
    log.info("section %s", name)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # one section's failure is recorded; the others still run
        log.exception("section %s failed", name)
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-6000:],
        }
    seconds = round(time.perf_counter() - start, 2)
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"ok": result.pop("ok", True), "seconds": seconds, **result}


def section_plan(scale: workload.Scale, sections: dict, folder: Path) -> dict:
    """name -> the call that produces its report (later sections read earlier ones' results)."""

    def device() -> dict:
        with probes.process_group(scale.device, scale.backend):
            return probes.device_report(scale.device)

    def fsdp_train() -> dict:
        ceiling = sections.get("matmul_ceiling", {}).get("ceiling_tflops")
        name = torch.cuda.get_device_name(0) if scale.device == "cuda" else None
        spec = probes.spec_peak_tflops(name)
        return train_check.fsdp_throughput(scale, ceiling_tflops=ceiling, spec_tflops=spec)

    return {
        "cuda": device,
        "matmul_ceiling": lambda: probes.matmul_ceiling(scale.device, scale.matmul_sizes),
        "fsdp_train": fsdp_train,
        "dcp_resume": lambda: dcp_check.dcp_resume(scale, folder / "dcp"),
        "logprob_error": lambda: logprob_check.logprob_error(scale),
        "memory_fit": lambda: memory_check.memory_fit(scale),
    }


def run_all(scale: workload.Scale, wanted: list[str]) -> dict:
    """Every wanted section in order; name -> report."""
    if scale.device == "cuda" and not torch.cuda.is_available():
        failure = {"ok": False, "error": "CUDA is not available (use --cpu-smoke on a machine without a GPU)"}
        return {name: dict(failure) for name in wanted}
    sections: dict = {}
    with tempfile.TemporaryDirectory(prefix="vlmrun-gpu-check-") as folder:
        plan = section_plan(scale, sections, Path(folder))
        for name in wanted:
            sections[name] = run_section(name, plan[name], scale.device)
    return sections


def write_report(report: dict, out: Path | None) -> None:
    """Print the JSON, and write it to `out` (or $OUT/gpu_check.json when $OUT is set)."""
    written = report_file.write_report(report, out, "gpu_check.json")
    if written is not None:
        log.info("wrote %s", written)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    make_scale = workload.cpu_smoke_scale if args.cpu_smoke else workload.gpu_scale
    scale = make_scale(
        seq_len=args.seq_len,
        steps=args.steps,
        warmup_steps=args.warmup,
        activation_checkpointing=args.activation_checkpointing,
    )
    start = time.perf_counter()
    setters = probes.fsdp_api()
    wanted = [name for name in SECTIONS if name in args.sections.split(",")]
    sections = run_all(scale, wanted)
    failed = [name for name, result in sections.items() if not result["ok"]]
    report = {
        "schema": 1,
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "ok": not failed,
        "failed": failed,
        "seconds": round(time.perf_counter() - start, 1),
        "argv": sys.argv[1:] if argv is None else argv,
        "environment": environment(setters),
        "sections": sections,
    }
    write_report(report, args.out)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
