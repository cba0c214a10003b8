"""Policy load cost: the sharded load (each rank reads only its rows of the safetensors files,
vlmrun/models/sharded_load.py) against the whole load it replaced (`from_pretrained` of the whole
model on every rank, then FSDP2 shards it), side by side in one run, as JSON.

    .venv/bin/python tools/bench_load.py --size mid --ranks 2 --rounds 3 --json

The model is random-init from a config (the Qwen2.5-VL layout; `mid`: ~0.27B parameters, `tiny`: for
the tests), saved once with `save_pretrained` as safetensors in `--disk-dtype` (bf16, as published
checkpoints are), and loaded as the GPU recipes load it: fp32 master weights, FSDP2 over `--ranks`
gloo ranks, through vlmrun's hf policy (`open_policy(...).setup`). Each round starts a fresh set of
ranks per variant, interleaved (sharded, whole, sharded, ...); each rank takes its peak resident
memory during `setup` beyond what it held before (VmHWM after resetting it through
/proc/self/clear_refs, less VmRSS before; the family's modules imported first) and the seconds
`setup` took (the process group, the model, the optimizer). The whole variant is the
product's own fallback (the path a directory the reader cannot map takes). Peaks are against the
bytes of the whole model in the policy's dtype (what `from_pretrained` held per rank); the time ratio
is the median of the per-round ratios with their spread.

A third variant, `resume`, is a resume's policy start: `setup(weights="checkpoint")` (the model
allocated, nothing of the directory read), then the checkpoint's model, optimizer and LR schedule read
into it (`Checkpoint.read_policy`, `load_checkpoint_state`), from a sealed checkpoint (model and AdamW
state) that the first round's sharded ranks write after their measurement; its time adds the job's check of that checkpoint
(`verify`: every file hashed, on the store's threads) and is set against the cold start's `setup`
(`resume_over_cold_s`). The rest of an attempt's start (Ray, the loaders) is the same in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from bench_refit import SIZES
from gpu.workload import TRAIN, free_port, model_config, sharded_parallel
from measure_memory import status_kb

from vlmrun.checkpoint.read import verify
from vlmrun.checkpoint.store import CheckpointStore
from vlmrun.observe.ratios import ratio_spread, round_ratios


def save_model(size: str, out: Path, disk_dtype: str) -> int:
    """The random-init model of `size` saved under `out`; returns its parameter count."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    values = dict(model_config(SIZES[size]))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, disk_dtype))
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _rank(
    rank: int, world: int, model_dir: str, variant: str, port: int, out: str, checkpoint: str, write_to: str
) -> None:
    import os

    from vlmrun.models import sharded_load
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    if variant == "whole":  # the product's fallback: every rank loads the whole model, then shards it
        sharded_load.plan_load = lambda model, directory: (None, "bench_load: the whole load")
    parallel = sharded_parallel()
    policy = open_policy(
        "hf", model=ModelSpec(directory=model_dir), rank=rank, world_size=world, train=TRAIN, parallel=parallel
    )
    import gc

    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):  # imports the family's modules before the measurement starts
        AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    if variant == "resume":
        from vlmrun.checkpoint.manifest import read_manifest
        from vlmrun.checkpoint.read import Checkpoint

        info = policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=1, weights="checkpoint")
        found = Checkpoint(1, Path(checkpoint), read_manifest(Path(checkpoint)))
        t1 = time.perf_counter()
        state = found.read_policy(policy.checkpoint_state())
        t2 = time.perf_counter()
        policy.load_checkpoint_state(state)
        info["parts_s"] = {"setup": t1 - t0, "read": t2 - t1, "apply": time.perf_counter() - t2}
    else:
        info = policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=1)
    seconds = time.perf_counter() - t0
    peak = status_kb("VmHWM") - before
    if write_to:  # the checkpoint the resume rounds read (model and AdamW state), after the measurement
        import torch.distributed as dist

        from vlmrun.checkpoint.write import PendingCheckpoint

        folder = Path(write_to)
        files = PendingCheckpoint(1, str(folder)).write_policy(policy.checkpoint_state(), rank=rank)
        every = [None] * world
        dist.all_gather_object(every, files)
        if rank == 0:
            (folder / "files.json").write_text(json.dumps({n: d.to_json() for f in every for n, d in f.items()}))
    Path(f"{out}.{rank}").write_text(
        json.dumps({"peak_extra_bytes": peak << 10, "seconds": seconds, "load": info["load"], **info})
    )
    policy.shutdown()
    os._exit(0)  # skip interpreter teardown: gloo's threads sometimes abort in C++ destructors at exit


def one(
    model_dir: Path, variant: str, ranks: int, work: Path, checkpoint: Path | None = None, write_to: Path | None = None
) -> list[dict]:
    """A fresh set of `ranks` ranks set up the policy of `variant` once; each rank's row. With `write_to`,
    they then write the policy's parts of a checkpoint into that pending checkpoint folder."""
    out = work / f"{variant}-{time.monotonic_ns()}"
    args = (ranks, str(model_dir), variant, free_port(), str(out), str(checkpoint or ""), str(write_to or ""))
    mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def seal(store, pending) -> Path:
    """The checkpoint the ranks wrote into `pending`, with a controller part, sealed as a run's save
    leaves it."""
    from vlmrun.checkpoint.files import Digest

    written = json.loads((Path(pending.path) / "files.json").read_text())
    files = {name: Digest.from_json(entry) for name, entry in written.items()}
    (Path(pending.path) / "files.json").unlink()
    files |= pending.write("controller", {"step": 1})
    return store.finish(pending, files, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="mid")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disk-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-load-") as tmp:
        work = Path(tmp)
        params = save_model(args.size, work / "model", args.disk_dtype)
        store = CheckpointStore(work / "checkpoints", keep=1)
        pending, checkpoint = store.begin(1), None
        rows: dict[str, list[list[dict]]] = {"sharded": [], "whole": [], "resume": []}
        verify_s: list[float] = []
        for n in range(args.rounds):  # interleaved rounds, a fresh set of ranks each time
            for variant in rows:
                if variant == "resume":
                    t0 = time.perf_counter()
                    verify(checkpoint)
                    verify_s.append(time.perf_counter() - t0)
                writes = variant == "sharded" and n == 0
                got = one(work / "model", variant, args.ranks, work, checkpoint, Path(pending.path) if writes else None)
                rows[variant].append(got)
                if writes:
                    checkpoint = seal(store, pending)
        checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    model_bytes = params * 4  # fp32 master weights: what `from_pretrained` held on every rank

    def summary(variant: str) -> dict:
        peaks = [max(r["peak_extra_bytes"] for r in rnd) for rnd in rows[variant]]  # the worst rank per round
        secs = [max(r["seconds"] for r in rnd) for rnd in rows[variant]]
        return {
            "peak_extra_bytes_max": max(peaks),
            "peak_over_model": round(max(peaks) / model_bytes, 3),
            "seconds_median": round(statistics.median(secs), 3),
            "seconds": [round(s, 3) for s in secs],
            "load": rows[variant][0][0]["load"],
            **(
                {"parts_s": [{k: round(v, 3) for k, v in rnd[0]["parts_s"].items()} for rnd in rows[variant]]}
                if "parts_s" in rows[variant][0][0]
                else {}
            ),
        }

    sharded, whole, resume = summary("sharded"), summary("whole"), summary("resume")
    resume["verify_s"] = [round(s, 3) for s in verify_s]
    resume["checkpoint_bytes"] = checkpoint_bytes
    resume_total = [v + s for v, s in zip(verify_s, resume["seconds"], strict=True)]
    report = {
        "size": args.size,
        "params": params,
        "ranks": args.ranks,
        "rounds": args.rounds,
        "disk_dtype": args.disk_dtype,
        "model_bytes": model_bytes,
        "sharded": sharded,
        "whole": whole,
        "sharded_over_whole_peak": round(sharded["peak_extra_bytes_max"] / max(whole["peak_extra_bytes_max"], 1), 3),
        "sharded_over_whole_s": ratio_spread(round_ratios(sharded["seconds"], whole["seconds"])),  # per round
        "resume": resume,
        "resume_over_cold_s": ratio_spread(round_ratios(resume_total, sharded["seconds"])),  # verify + load
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
