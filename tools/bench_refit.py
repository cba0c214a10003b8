"""Refit cost: the streamed refit (the product's, algorithms/common/refit.py) against the whole-model
refit it replaced (gather the full state dict, then `load_state_dict`), side by side, as JSON.

    .venv/bin/python tools/bench_refit.py --size mid --ranks 2 --bucket-mb 64 --rounds 3 --json

Each of `--ranks` gloo ranks (CPU) holds vlmrun's hf policy sharded with FSDP2 (fp32 master weights,
random init from a config, built on the meta device) and an hf generation engine of the same
architecture in bf16, as a GRPO rank does. In rounds, interleaved (streamed, whole, streamed, ...),
the same processes time rank 0's refit and take its peak memory beyond what was alive before it, two
ways (tools/measure_memory.py): the bytes allocated by the CPU allocator (torch.profiler, exact per
allocation and free on the refit's thread), and the resident bytes of the whole process (every thread,
in pages), the latter while the refit is timed. `plain_load_s` is `load_state_dict` of an already gathered bf16 state dict
into the engine: the floor of any refit. Sizes: `tiny` (the 3B layout cut to ~0.3M parameters, for
the tests) and `mid` (the Qwen2.5-VL layout at ~0.27B parameters).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from gpu.workload import TINY_OVERRIDES, TRAIN, free_port, model_config, sharded_parallel
from measure_memory import profiled_peak, rss_peak

#: The Qwen2.5-VL-3B layout narrowed to ~0.27B parameters (vocabulary kept: its tied embedding is the
#: largest tensor, 0.3 GB in bf16, larger than a default bucket).
MID_OVERRIDES = {
    "text_config": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6, "num_attention_heads": 16},
    "vision_config": {"depth": 2, "fullatt_block_indexes": [1], "out_hidden_size": 1024},
}
SIZES = {"tiny": TINY_OVERRIDES, "mid": MID_OVERRIDES}


def streamed(engine, policy, bucket_bytes: int) -> None:
    """The product's refit: buckets of whole bf16 tensors, each copied into the engine's own."""
    from vlmrun.algorithms.common.refit import refit

    refit(engine, policy, bucket_bytes=bucket_bytes)


def whole(engine, policy, bucket_bytes: int) -> None:
    """The refit before: the full fp32 state dict gathered on every rank, then `load_state_dict`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True))
    engine.model.load_state_dict({n: t.detach().cpu() for n, t in full.items()}, strict=True)


VARIANTS = {"streamed": streamed, "whole": whole}


def _rank(rank: int, world: int, size: str, rounds: int, bucket_mb: int, port: int, out: str) -> None:
    import gc

    import torch.distributed as dist

    from vlmrun.generation import open_generator
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    config = model_config(SIZES[size])
    parallel = sharded_parallel()
    policy = open_policy(
        "hf", model=ModelSpec(config=config, seed=1), rank=rank, world_size=world, train=TRAIN, parallel=parallel
    )
    policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=1)  # joins the ranks' gloo group
    engine = open_generator("hf", model=ModelSpec(config=config, seed=2, dtype="bfloat16"))
    engine.setup()
    engine_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    largest = max(t.numel() for t in engine.model.state_dict().values()) * 2
    rows: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):  # interleaved: streamed, whole, streamed, whole, ...
        for variant, refit_by in VARIANTS.items():
            gc.collect()
            dist.barrier()
            run = functools.partial(refit_by, engine, policy, bucket_mb << 20)
            peak = profiled_peak(run)  # bytes allocated beyond what was alive before the call
            rss, seconds = rss_peak(run)  # timed again, unprofiled
            rows[variant].append({"peak_extra_bytes": peak, "peak_extra_rss_bytes": rss, "seconds": seconds})
    gathered = {
        n: t.clone() for b in policy.weights_for_refit(dtype="bfloat16", bucket_bytes=1 << 40) for n, t in b.items()
    }
    t0 = time.perf_counter()
    missing, unexpected = engine.model.load_state_dict(gathered, strict=False)
    tied = {n for n, p in engine.model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in engine.model.named_parameters()
    }
    assert not unexpected and set(missing) <= tied, (missing, unexpected)  # a tied weight comes once, by its first name
    plain = time.perf_counter() - t0
    report = {"rows": rows, "plain_load_s": plain, "engine_bytes": engine_bytes, "largest_tensor_bytes": largest}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        Path(out).write_text(json.dumps(reports[0]))
    dist.barrier()
    policy.shutdown()  # drops the model, then leaves the process group
    del run, engine, policy, gathered
    gc.collect()


def measure(size: str, rounds: int, ranks: int, bucket_mb: int) -> dict:
    """Rank 0's rows, from one set of `ranks` processes that hold the policy and the engine."""
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-refit-") as tmp:
        out = Path(tmp) / "report.json"
        args = (ranks, size, rounds, bucket_mb, free_port(), str(out))
        mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="mid")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    first = measure(args.size, args.rounds, args.ranks, args.bucket_mb)
    rows = first["rows"]

    def summary(variant: str) -> dict:
        r = rows[variant]
        secs = [x["seconds"] for x in r]
        return {
            "peak_extra_bytes": max(x["peak_extra_bytes"] for x in r),
            "peak_extra_rss_bytes": max(x["peak_extra_rss_bytes"] for x in r),
            "peak_extra_bytes_rounds": [x["peak_extra_bytes"] for x in r],
            "peak_extra_rss_bytes_rounds": [x["peak_extra_rss_bytes"] for x in r],
            "seconds_median": statistics.median(secs),
            "seconds": secs,
        }

    streamed, whole = summary("streamed"), summary("whole")
    bucket = args.bucket_mb << 20
    report = {
        "size": args.size,
        "ranks": args.ranks,
        "bucket_mb": args.bucket_mb,
        "rounds": args.rounds,
        "engine_bytes": first["engine_bytes"],
        "largest_tensor_bytes": first["largest_tensor_bytes"],
        "streamed": streamed,
        "whole": whole,
        "plain_load_s": first["plain_load_s"],
        "streamed_peak_over_bucket": round(streamed["peak_extra_bytes"] / bucket, 3),
        "streamed_rss_peak_over_bucket": round(streamed["peak_extra_rss_bytes"] / bucket, 3),
        "whole_peak_over_engine": round(whole["peak_extra_bytes"] / first["engine_bytes"], 3),
        "streamed_over_whole_s": round(streamed["seconds_median"] / whole["seconds_median"], 3),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
