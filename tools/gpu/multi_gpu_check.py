"""Multi-GPU check: vlmrun's sharded policy over several GPUs of one machine and NCCL, as one JSON.

    PYTHONPATH=. python tools/gpu/multi_gpu_check.py --out $OUT/multi_gpu_check.json          # every GPU here
    PYTHONPATH=. python tools/gpu/multi_gpu_check.py --cpu-smoke --out /tmp/multi.json         # 2 gloo ranks (CI)

Each case spawns one process per rank (no Ray: each process sees its own GPU through
CUDA_VISIBLE_DEVICES, as a Ray rank does) and opens vlmrun's `hf` policy as a run's rank does
(`open_policy` with a config for random init: built on the meta device, each rank its own shards; on a
CUDA mesh the values an unsharded build would have), fp32 master weights under bf16 mixed precision:

  layouts   fsdp: FSDP2 over every rank; hsdp: 2 replicas of the sharded state (`dp_shard` = ranks / 2);
            offload: FSDP2 with parallel.cpu_offload and gradients reduce-scattered every micro-batch
            (the Omni recipes' layout: shards, gradients and AdamW on the host, the norm over CPU tensors;
            not on --cpu-smoke, whose host is the device)
  models    tiny: the 3B layout cut to ~0.2M parameters; 3b: the Qwen2.5-VL-3B architecture (3.75B)
  each      `--steps` steps of 2 micro-batches a rank, one 448 px image a sequence, rank 0's second
            micro-batch text-only (the towers get no gradient there: the reduce-scatter of unused
            parameters), then a DCP round trip through the checkpoint store (every rank its shard; a
            fresh policy of another seed loads it and takes the next step: the same loss, bit for bit)

Per case: losses and gradient norms (every layout starts from the same weights: the first loss must
agree across layouts), seconds a step, training tokens/s per GPU and MFU against the bf16 matmul
ceiling measured here, and each rank's peak allocated memory in the step against the fit check's
estimate of the same shape (models/memory.py, less its fixed overhead). A case that exceeds
`--time-limit` seconds (a collective that never completes) is killed and reported as timed out; the
others still run. Imports only torch, numpy and transformers besides vlmrun: no Ray, no pydantic, no
network. Exit status 0 when every case is ok, 1 otherwise, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = ("fsdp", "hsdp", "offload")
MODELS = ("tiny", "3b")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/gpu/multi_gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks on the CPU, the tiny model only")
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU torch sees)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated of {', '.join(MODELS)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3, help="training steps a case (then the DCP round trip)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (GPU 2048, smoke 96)")
    parser.add_argument("--time-limit", type=int, default=600, help="seconds a case may take before it is killed")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here ($OUT/multi_gpu_check.json)")
    args = parser.parse_args(argv)
    for name, allowed in (("models", MODELS), ("layouts", LAYOUTS)):
        unknown = sorted(set(getattr(args, name).split(",")) - set(allowed))
        if unknown:
            parser.error(f"--{name}: unknown {unknown}; allowed: {', '.join(allowed)}")
    if args.cpu_smoke:  # offload pins host memory for a GPU: there is none
        args.models, args.gpus = "tiny", args.gpus or 2
        args.layouts = ",".join(x for x in args.layouts.split(",") if x != "offload") or "fsdp"
    args.seq_len = args.seq_len or (96 if args.cpu_smoke else 2048)
    return args


def parallel_of(layout: str, ranks: int) -> SimpleNamespace:
    """The recipe's `parallel` section as the policy reads it, for `layout` over `ranks`."""
    return SimpleNamespace(
        fsdp=True,
        mixed_precision="bf16",
        activation_checkpointing=False,
        cpu_offload=layout == "offload",
        reduce_every_micro_batch=layout == "offload",
        dp_shard=max(1, ranks // 2) if layout == "hsdp" else None,
    )


def rank_batches(config: dict, rank: int, seq_len: int, side: int) -> list:
    """A rank's two micro-batches: an image sequence each, rank 0's second text-only."""
    import torch
    import workload

    from vlmrun.data.batch import IGNORE_INDEX, Batch

    first = workload.synthetic_batch(config, seq_len=seq_len, image_side=side, seed=10 * rank + 1)
    if rank != 0:
        return [first, workload.synthetic_batch(config, seq_len=seq_len, image_side=side, seed=10 * rank + 2)]
    g = torch.Generator().manual_seed(99)
    words = min(config["image_token_id"], config["text_config"]["vocab_size"]) - 8
    ids = torch.randint(0, words, (1, seq_len), generator=g)
    labels = ids.clone()
    labels[:, :8] = IGNORE_INDEX
    return [first, Batch(["text-only"], ids, torch.ones_like(ids), labels)]


def _rank(rank: int, world: int, case: dict, folder: str) -> None:
    """One rank of a case: steps, the DCP round trip; writes its JSON (or its error) to the folder."""
    out = Path(folder) / f"{case['name']}.{rank}.json"
    if case["device"] == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # the rank's own GPU, as Ray gives it
    try:
        out.write_text(json.dumps(run_case(rank, world, case, Path(folder))))
    except Exception as e:  # noqa: BLE001 - the case's JSON says what broke
        out.write_text(
            json.dumps({"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]})
        )
    os._exit(0)  # skip interpreter teardown: gloo's and NCCL's threads sometimes abort in destructors


def _open(config: dict, case: dict, rank: int, world: int, seed: int):
    import workload

    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    policy = open_policy(
        "hf",
        model=ModelSpec(config=config, seed=seed),
        rank=rank,
        world_size=world,
        train=workload.TRAIN,
        parallel=parallel_of(case["layout"], world),
        gpus=case["device"] == "cuda",
    )
    policy.setup(master_addr="127.0.0.1", master_port=case["ports"][seed], max_steps=100)
    return policy


def run_case(rank: int, world: int, case: dict, folder: Path) -> dict:
    import torch
    import workload

    config = workload.model_config(case["overrides"])
    batches = rank_batches(config, rank, case["seq_len"], case["image_side"])
    cuda = case["device"] == "cuda"
    policy = _open(config, case, rank, world, seed=0)
    rows, peaks = [], []
    for _ in range(case["steps"]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = policy.train_step(batches)
        if cuda:
            torch.cuda.synchronize()
        rows.append({"loss": result.loss, "grad_norm": result.grad_norm, "step_s": time.perf_counter() - t0})
        peaks.append(torch.cuda.max_memory_allocated() if cuda else None)
    report = {"rows": rows, "peak_allocated": peaks, "layout": policy.layout(), "host_peak_mb": result.peak_rss_mb}
    report |= dcp_round_trip(policy, config, case, rank, world, folder, batches)
    return report


def dcp_round_trip(policy, config: dict, case: dict, rank: int, world: int, folder: Path, batches) -> dict:
    """Save through the checkpoint store (every rank its shard), take the next step; a fresh policy of
    another seed loads the checkpoint and takes the same step: its loss must be the same, bit for bit."""
    import torch.distributed as dist

    from vlmrun.checkpoint.store import CheckpointStore

    store = CheckpointStore(folder / f"dcp-{case['name']}", keep=1)
    begun = [store.begin(case["steps"]) if rank == 0 else None]  # one rank begins it, as a run's controller
    dist.broadcast_object_list(begun, src=0)
    pending = begun[0]
    files = pending.write_policy(policy.checkpoint_state(), rank=rank)
    every = [None] * world
    dist.all_gather_object(every, files)
    if rank == 0:
        merged = {name: digest for part in every for name, digest in part.items()}
        store.finish(pending, merged | pending.write("controller", {"counters": {}}), None)
    dist.barrier()
    after_save = policy.train_step(batches).loss
    policy.shutdown()
    fresh = _open(config, case, rank, world, seed=1)
    with store.reading(case["steps"]) as (saved, _):
        fresh.load_checkpoint_state(saved.read_policy(fresh.checkpoint_state()))
    after_load = fresh.train_step(batches).loss
    fresh.shutdown()
    return {
        "next_loss_after_save": after_save,
        "next_loss_after_load": after_load,
        "dcp_equal": after_save == after_load,
    }


def run_cases(args: argparse.Namespace, folder: Path) -> dict:
    """Every case, one after the other, each killed at `--time-limit`; name -> its summary."""
    import torch.multiprocessing as mp
    import workload

    device = "cpu" if args.cpu_smoke else "cuda"
    results = {}
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            case = {
                "name": f"{model}-{layout}",
                "model": model,
                "layout": layout,
                "device": device,
                "overrides": workload.TINY_OVERRIDES if model == "tiny" else {},
                "seq_len": args.seq_len,
                "image_side": 112 if args.cpu_smoke else 448,
                "steps": args.steps,
                "ports": [workload.free_port(), workload.free_port()],
            }
            t0 = time.perf_counter()
            context = mp.start_processes(
                _rank, args=(args.gpus, case, str(folder)), nprocs=args.gpus, join=False, start_method="spawn"
            )
            timed_out = not _joined(context, args.time_limit)
            ranks = [_read(folder / f"{case['name']}.{r}.json") for r in range(args.gpus)]
            results[case["name"]] = summarize(case, ranks, args.gpus, timed_out, time.perf_counter() - t0)
    return results


def _joined(context, limit: float) -> bool:
    """Wait for every rank; False (the ranks killed) when they outlast `limit` seconds."""
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                return False
    except Exception:  # noqa: BLE001 - a rank that died: its JSON (or its absence) says so
        pass
    return True


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"error": "the rank wrote no result"}


def summarize(case: dict, ranks: list[dict], world: int, timed_out: bool, seconds: float) -> dict:
    """A case's JSON: its ranks' rows, and what the check holds them to."""
    failed = [r.get("error") for r in ranks if "error" in r]
    out = {"layout": case["layout"], "model": case["model"], "ranks": world, "seconds": round(seconds, 1)}
    if timed_out or failed:
        return out | {
            "ok": False,
            "timed_out": timed_out,
            "errors": failed,
            "tracebacks": [r.get("traceback") for r in ranks],
        }
    rows = ranks[0]["rows"]
    steady = sorted(r["step_s"] for r in rows[1:] or rows)
    step_s = steady[len(steady) // 2]
    losses = [r["loss"] for r in rows]
    out |= {
        "policy_layout": ranks[0]["layout"],
        "losses": losses,
        "grad_norms": [r["grad_norm"] for r in rows],
        "ranks_agree": all(r["rows"] == rows or [x["loss"] for x in r["rows"]] == losses for r in ranks),
        "step_s": round(step_s, 4),
        "tokens_per_s_per_gpu": round(2 * case["seq_len"] / step_s, 1),
        "peak_allocated_per_rank": [max(p or 0 for p in r["peak_allocated"]) or None for r in ranks],
        "host_peak_mb_per_rank": [r["host_peak_mb"] for r in ranks],
        "dcp_equal": all(r["dcp_equal"] for r in ranks),
        "next_loss_after_save_and_load": [ranks[0]["next_loss_after_save"], ranks[0]["next_loss_after_load"]],
    }
    out |= estimate_against(case, world, out["peak_allocated_per_rank"])
    finite = all(x == x and abs(x) < 1e4 for x in losses)
    out["ok"] = finite and out["dcp_equal"] and out["ranks_agree"]
    return out


def estimate_against(case: dict, world: int, peaks: list) -> dict:
    """The fit check's estimate of the case's shape (less its fixed overhead) beside the measured peaks."""
    import workload

    from vlmrun.models.memory import TrainingShape, estimate_memory
    from vlmrun.models.params import count_architecture

    parallel = parallel_of(case["layout"], world)
    shape = TrainingShape(
        mixed_precision="bf16",
        fsdp=True,
        dp=parallel.dp_shard or world,
        cpu_offload=parallel.cpu_offload,
        reduce_every_micro_batch=parallel.reduce_every_micro_batch,
        sequences=1,
        micro_batches=2,
        seq_len=case["seq_len"],
        image_size=case["image_side"],
        on_gpu=case["device"] == "cuda",
    )
    estimate = estimate_memory(count_architecture("qwen2_5_vl", workload.model_config(case["overrides"])), shape)
    without = estimate.device_total - estimate.overhead
    measured = max((p for p in peaks if p), default=None)
    ratio = round(without / measured, 3) if measured else None
    return {
        "estimate_without_overhead": without,
        "estimate_over_peak": ratio,
        "estimate_peak_phase": estimate.peak_phase,
    }


def with_mfu(results: dict, args: argparse.Namespace) -> dict:
    """Each case's MFU against the bf16 matmul ceiling measured here (after the cases: no CUDA before them)."""
    import probes
    import workload

    from vlmrun.models.build import build_model
    from vlmrun.models.spec import ModelSpec

    device = "cpu" if args.cpu_smoke else "cuda"
    ceiling = probes.matmul_ceiling(device, (128, 256) if args.cpu_smoke else (4096, 8192, 16384))
    for row in results.values():
        if not row.get("ok"):
            continue
        config = workload.model_config(workload.TINY_OVERRIDES if row["model"] == "tiny" else {})
        probe = build_model(ModelSpec(config=config), on_meta=True)
        flops = sum(
            workload.training_flops(probe, b)["total"]
            for b in rank_batches(config, 1, args.seq_len, 112 if args.cpu_smoke else 448)
        )
        row["flops_per_rank_step"] = flops
        row["mfu_vs_ceiling"] = round(flops / row["step_s"] / (ceiling["ceiling_tflops"] * 1e12), 4)
        del probe
    return {"matmul_ceiling": ceiling, "cases": results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: run it on a GPU machine, or --cpu-smoke"}))
        return 1
    args.gpus = args.gpus or torch.cuda.device_count()
    if args.gpus < 2:
        print(json.dumps({"ok": False, "error": f"{args.gpus} GPU(s): the check needs at least 2"}))
        return 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlmrun-multi-gpu-") as folder:
        report = with_mfu(run_cases(args, Path(folder)), args)
    firsts = {}
    for row in report["cases"].values():
        if row.get("ok"):
            firsts.setdefault(row["model"], []).append(row["losses"][0])
    # on a CUDA mesh every layout starts from the unsharded init (models/build.py, 3); a CPU mesh's differs
    agree = {m: max(v) - min(v) <= 1e-3 * max(1.0, abs(v[0])) for m, v in firsts.items()} if not args.cpu_smoke else {}
    report |= {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "torch": torch.__version__,
        "first_loss_agrees_across_layouts": agree,
        "seconds": round(time.perf_counter() - started, 1),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    report["ok"] = all(r.get("ok") for r in report["cases"].values()) and all(agree.values())
    from report import write_report

    write_report(report, args.out, "multi_gpu_check.json")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
