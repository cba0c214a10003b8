"""Checkpoint save cost: the sharded path (every rank writes its DCP shard, hashed as it is written)
against one plain `torch.save` of the same model and optimizer state, measured side by side in one run.

    .venv/bin/python tools/bench_checkpoint.py --mb 512 --ranks 2 --json

The model is a stack of Linear layers of `--mb` MB of fp32 parameters, sharded with FSDP2 over
`--ranks` gloo ranks (one unit per layer); one AdamW step gives it optimizer state (2x the
parameters). Prints one JSON object: seconds for the plain save and for the sharded save (the slowest
rank; its checksums included), their ratio, `readback_hash_s`: what hashing the rank's files by
reading them back (as saves did before, here from a warm page cache) would add, a resume's check of
the sealed checkpoint (`verify`) on its threads against one thread (`verify_threads_over_one`), and a
background save (`checkpoint.async_save`: DCP's async_save over a process group of its own): what it
holds the step up (`async_stall_s`, the copy into host memory) and its start to the files written
(`async_total_s`). Files go under --dir (default: a temp dir on the same filesystem as /tmp) and are
removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WIDTH = 2048  # one layer: WIDTH x WIDTH fp32 = 16 MB


def build(mb: int) -> tuple[torch.nn.Module, int]:
    """The model (seeded) and its layer count."""
    torch.manual_seed(0)
    layers = max(1, mb // (WIDTH * WIDTH * 4 >> 20))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    return model, layers


def step(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One AdamW step, so the optimizer holds its two moments per parameter."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    return optimizer


def plain_save(mb: int, folder: Path) -> dict:
    model, layers = build(mb)
    optimizer = step(model)
    path = folder / "plain.pt"
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": path.stat().st_size, "layers": layers}


def _rank(rank: int, world: int, mb: int, folder: str, rendezvous: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vlmrun.algorithms.common.checkpoint import digest
    from vlmrun.algorithms.common.checkpoint_store import CheckpointStore
    from vlmrun.policy.interface import MODEL_PART, OPTIMIZER_PART, PolicyState, Storage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    model, _ = build(mb)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = step(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    background = dist.new_group(backend="gloo")  # what a rank with checkpoint.async_save makes at setup
    store = CheckpointStore(Path(folder) / "sharded", keep=2)
    box = [store.begin(1), store.begin(2)] if rank == 0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    t0 = time.perf_counter()
    state = PolicyState(Storage.SHARDED, {MODEL_PART: model_state, OPTIMIZER_PART: optim_state})
    files = box[0].write_policy(state, rank=rank)
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, recorded in files.items():
        if digest(Path(box[0].path) / name) != recorded:
            raise SystemExit(f"rank {rank}: {name}'s digest, taken while writing, differs from the file's")
    hashing = time.perf_counter() - t0  # a read-back hash, from a warm page cache
    size = sum(d["size"] for d in files.values())
    dist.barrier()
    t0 = time.perf_counter()
    write = box[1].start_policy_write(state, rank=rank, group=background)
    stall = time.perf_counter() - t0
    async_files = write.result()
    async_total = time.perf_counter() - t0
    if {n: d["size"] for n, d in async_files.items()} != {n: d["size"] for n, d in files.items()}:
        raise SystemExit(f"rank {rank}: the background save wrote other files than the save in the step")
    results, written = [None] * world, [None] * world
    row = {"total": total, "hash": hashing, "bytes": size, "async_stall": stall, "async_total": async_total}
    dist.all_gather_object(results, row)
    dist.all_gather_object(written, files)
    if rank == 0:
        seal_and_time_verify(store, box[0], written, results)
        Path(out).write_text(json.dumps(results))
    # Nothing may hold the process group past destroy: a mesh or FSDP module still alive at interpreter
    # exit aborted the rank there ("terminate called without an active exception", 2 runs in 15 here).
    dist.barrier()
    del model, optimizer, model_state, optim_state, state, mesh
    gc.collect()
    dist.destroy_process_group()


def seal_and_time_verify(store, pending, written: list[dict], results: list[dict], rounds: int = 3) -> None:
    """Seal the checkpoint the ranks wrote (and a controller part), then time what a resume's check
    costs: `verify` hashing every file on its threads against one thread, interleaved rounds (warm page
    cache: the CPU's share of it). Adds {verify_s, verify_one_thread_s} (medians) to results[0]."""
    import statistics

    from vlmrun.algorithms.common.checkpoint import verify

    files = {name: d for rank_files in written for name, d in rank_files.items()}
    files |= pending.write("controller", {"step": 1})
    path = store.finish(pending, files, {})
    timed: dict[int | None, list[float]] = {None: [], 1: []}
    for _ in range(rounds):
        for threads in timed:
            t0 = time.perf_counter()
            verify(path, threads=threads)
            timed[threads].append(time.perf_counter() - t0)
    results[0]["verify_s"] = statistics.median(timed[None])
    results[0]["verify_one_thread_s"] = statistics.median(timed[1])


def sharded_save(mb: int, ranks: int, folder: Path) -> dict:
    out = folder / "ranks.json"
    # A file rendezvous: no port picked here that another process could take before rank 0 binds it.
    rendezvous = f"file://{folder / 'rendezvous'}"
    mp.start_processes(_rank, args=(ranks, mb, str(folder), rendezvous, str(out)), nprocs=ranks, start_method="spawn")
    per_rank = json.loads(out.read_text())
    slowest = max(per_rank, key=lambda r: r["total"])
    return {
        "seconds": slowest["total"],
        "async_stall_s": max(r["async_stall"] for r in per_rank),
        "async_total_s": max(r["async_total"] for r in per_rank),
        "readback_hash_s": slowest["hash"],
        "verify_s": per_rank[0].pop("verify_s"),
        "verify_one_thread_s": per_rank[0].pop("verify_one_thread_s"),
        "bytes": sum(r["bytes"] for r in per_rank),
        "per_rank": per_rank,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512, help="fp32 parameter MB (the checkpoint is ~3x)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-ckpt-", dir=args.dir) as tmp:
        folder = Path(tmp)
        plain = plain_save(args.mb, folder)
        (folder / "plain.pt").unlink()
        sharded = sharded_save(args.mb, args.ranks, folder)
    report = {
        "param_mb": args.mb,
        "ranks": args.ranks,
        "plain_torch_save": plain,
        "sharded_dcp": sharded,
        "sharded_over_plain": round(sharded["seconds"] / plain["seconds"], 3),
        "readback_hash_over_save": round(sharded["readback_hash_s"] / max(sharded["seconds"], 1e-9), 3),
        "verify_threads_over_one": round(sharded["verify_s"] / max(sharded["verify_one_thread_s"], 1e-9), 3),
        "async_stall_over_save": round(sharded["async_stall_s"] / max(sharded["seconds"], 1e-9), 3),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
