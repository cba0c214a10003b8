"""Checkpoint save cost: the sharded path (every rank writes its DCP shard, hashed as it is written;
then the checkpoint is sealed: manifest, fsync, rename, which the step loop runs behind the next steps,
vlmrun/checkpoint/saving.py) against a plain `torch.save` of the same tensors (each rank its own
shard's), measured side by side in interleaved rounds in one run.

    .venv/bin/python tools/bench_checkpoint.py --mb 512 --ranks 2 --rounds 5 --json

The model is a stack of Linear layers of `--mb` MB of fp32 parameters, sharded with FSDP2 over
`--ranks` gloo ranks (one unit per layer); one AdamW step gives it optimizer state (2x the
parameters). Each round times, in alternating order, every rank's `torch.save` of its local shard
(model and optimizer tensors; also with an fsync, what a durable plain save costs) and the product's
save of the same state (`write_policy` on every rank, then `CheckpointStore.finish` on rank 0): the
slowest rank's seconds of each, and their ratio per round, reported as the median with the spread.
`sharded_over_plain`: what the step waits for (the slowest rank's write) against plain `torch.save`
(neither waits for the disk); `sharded_over_plain_fsync`: the save until sealed (write + seal: on
disk) against `torch.save` + fsync. Then, once: `readback_hash_s`, what hashing the rank's files by reading them back (as saves
did before, here from a warm page cache) would add; a resume's check of the sealed checkpoint
(`verify`) on its threads against one thread (`verify_threads_over_one`); and a background save
(`checkpoint.async_save`: DCP's async_save over a process group of its own): what it holds the step
up (`async_stall_s`, the copy into host memory) and its start to the files written
(`async_total_s`). Files go under --dir (default: a temp dir on the same filesystem as /tmp) and are
removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from vlmrun.observe.ratios import ratio_spread, round_ratios

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


def _rank(rank: int, world: int, mb: int, rounds: int, folder: str, rendezvous: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vlmrun.checkpoint.files import digest
    from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, PolicyState, Storage
    from vlmrun.checkpoint.store import CheckpointStore

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
    state = PolicyState(Storage.SHARDED, {MODEL_PART: model_state, OPTIMIZER_PART: optim_state})
    timed = interleaved_rounds(rank, world, rounds, store, state, Path(folder))
    box = [store.begin(1), store.begin(2)] if rank == 0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    t0 = time.perf_counter()
    files = box[0].write_policy(state, rank=rank)
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, recorded in files.items():
        if digest(Path(box[0].path) / name) != recorded:
            raise SystemExit(f"rank {rank}: {name}'s digest, taken while writing, differs from the file's")
    hashing = time.perf_counter() - t0  # a read-back hash, from a warm page cache
    size = sum(d.size for d in files.values())
    dist.barrier()
    t0 = time.perf_counter()
    write = box[1].start_policy_write(state, rank=rank, group=background)
    stall = time.perf_counter() - t0
    async_files = write.result()
    async_total = time.perf_counter() - t0
    if {n: d.size for n, d in async_files.items()} != {n: d.size for n, d in files.items()}:
        raise SystemExit(f"rank {rank}: the background save wrote other files than the save in the step")
    results, written = [None] * world, [None] * world
    row = {"total": total, "hash": hashing, "bytes": size, "async_stall": stall, "async_total": async_total}
    dist.all_gather_object(results, row)
    dist.all_gather_object(written, files)
    if rank == 0:
        seal_and_time_verify(store, box[0], written, results)
        Path(out).write_text(json.dumps({"per_rank": results, "rounds": timed}))
    # Nothing may hold the process group past destroy: a mesh or FSDP module still alive at interpreter
    # exit aborted the rank there ("terminate called without an active exception", 2 runs in 15 here).
    dist.barrier()
    del model, optimizer, model_state, optim_state, state, mesh
    gc.collect()
    dist.destroy_process_group()


def interleaved_rounds(rank: int, world: int, rounds: int, store, state, folder: Path) -> list[dict]:
    """Per round, both sides one after the other (plain first in even rounds, sharded first in odd
    ones): every rank's `torch.save` of its local tensors (then an fsync), and the product's save of
    the same state (every rank's `write_policy`, rank 0's `finish`). Returns, on rank 0, per round the
    slowest rank's seconds: {"plain", "plain_fsync", "write", "seal", "sharded", "sealed"} and the plain files'
    bytes (all ranks); the files go after
    each round (the disk holds one checkpoint at a time)."""
    import torch.distributed as dist

    local = {part: {key: _local(value) for key, value in flat_items(tensors)} for part, tensors in state.parts.items()}
    out: list[dict] = []
    for r in range(rounds):
        mine: dict[str, float] = {}
        for side in ("plain", "sharded") if r % 2 == 0 else ("sharded", "plain"):
            dist.barrier()
            t0 = time.perf_counter()
            if side == "plain":
                path = folder / f"plain-{rank}.pt"
                torch.save(local, path)
                mine["plain"] = time.perf_counter() - t0
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                mine["plain_fsync"] = time.perf_counter() - t0
                mine["plain_bytes"] = path.stat().st_size
                path.unlink()
                continue
            box = [store.begin(100 + r)] if rank == 0 else [None]
            dist.broadcast_object_list(box, src=0)
            t0 = time.perf_counter()  # the folder's making is rank 0's alone: not a rank's write
            files = box[0].write_policy(state, rank=rank)
            mine["write"] = time.perf_counter() - t0
            written = [None] * world
            dist.all_gather_object(written, files)
            mine["seal"] = 0.0
            if rank == 0:
                t1 = time.perf_counter()
                every = {name: d for rank_files in written for name, d in rank_files.items()}
                every |= box[0].write("controller", {"step": 100 + r})
                sealed = store.finish(box[0], every, None)
                mine["seal"] = time.perf_counter() - t1
                shutil.rmtree(sealed)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        slowest = {key: max(g[key] for g in gathered) for key in ("plain", "plain_fsync", "write")}
        slowest["seal"] = gathered[0]["seal"]
        slowest["sharded"] = slowest["write"]  # what the step waits for: the seal runs behind the next steps
        slowest["sealed"] = slowest["write"] + slowest["seal"]
        slowest["plain_bytes"] = sum(g["plain_bytes"] for g in gathered)
        out.append(slowest)
    return out


def flat_items(tensors) -> list:
    """(key, value) pairs of a state dict, one level of nesting flattened (AdamW's per-parameter state)."""
    items = []
    for key, value in tensors.items():
        if isinstance(value, dict):
            items.extend((f"{key}.{k}", v) for k, v in flat_items(value))
        else:
            items.append((key, value))
    return items


def _local(value):
    """A DTensor's local shard (what this rank holds), anything else as it is."""
    return value.to_local() if hasattr(value, "to_local") else value


def seal_and_time_verify(store, pending, written: list[dict], results: list[dict], rounds: int = 3) -> None:
    """Seal the checkpoint the ranks wrote (and a controller part), then time what a resume's check
    costs: `verify` hashing every file on its threads against one thread, interleaved rounds (warm page
    cache: the CPU's share of it). Adds {verify_s, verify_one_thread_s} (medians) to results[0]."""
    import statistics

    from vlmrun.checkpoint.read import verify

    files = {name: d for rank_files in written for name, d in rank_files.items()}
    files |= pending.write("controller", {"step": 1})
    path = store.finish(pending, files, None)
    timed: dict[int | None, list[float]] = {None: [], 1: []}
    for _ in range(rounds):
        for threads in timed:
            t0 = time.perf_counter()
            verify(path, threads=threads)
            timed[threads].append(time.perf_counter() - t0)
    results[0]["verify_s"] = statistics.median(timed[None])
    results[0]["verify_one_thread_s"] = statistics.median(timed[1])


def measure(mb: int, ranks: int, rounds: int, folder: Path) -> tuple[dict, dict]:
    """(plain, sharded): the rounds' medians for each side, and the one-off measurements."""
    out = folder / "ranks.json"
    # A file rendezvous: no port picked here that another process could take before rank 0 binds it.
    rendezvous = f"file://{folder / 'rendezvous'}"
    mp.start_processes(
        _rank, args=(ranks, mb, rounds, str(folder), rendezvous, str(out)), nprocs=ranks, start_method="spawn"
    )
    report = json.loads(out.read_text())
    per_rank, timed = report["per_rank"], report["rounds"]
    slowest = max(per_rank, key=lambda r: r["total"])

    def median(key: str) -> float:
        return statistics.median(row[key] for row in timed)

    plain = {"seconds": median("plain"), "seconds_fsync": median("plain_fsync"), "bytes": timed[0]["plain_bytes"]}
    return plain, {
        "seconds": median("sharded"),
        "sealed_s": median("sealed"),
        "write_s": median("write"),
        "seal_s": median("seal"),
        "rounds": timed,
        "first_save_s": slowest["total"],
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
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of plain vs sharded saves")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-ckpt-", dir=args.dir) as tmp:
        plain, sharded = measure(args.mb, args.ranks, args.rounds, Path(tmp))
    rounds = sharded["rounds"]
    over_plain = ratio_spread(round_ratios([r["sharded"] for r in rounds], [r["plain"] for r in rounds]))
    over_fsync = ratio_spread(round_ratios([r["sealed"] for r in rounds], [r["plain_fsync"] for r in rounds]))
    report = {
        "param_mb": args.mb,
        "ranks": args.ranks,
        "plain_torch_save": plain,
        "sharded_dcp": sharded,
        "sharded_over_plain": over_plain["median"],
        "sharded_over_plain_rounds": over_plain,
        "sharded_over_plain_fsync": over_fsync,
        "readback_hash_over_save": round(sharded["readback_hash_s"] / max(sharded["seconds"], 1e-9), 3),
        "verify_threads_over_one": round(sharded["verify_s"] / max(sharded["verify_one_thread_s"], 1e-9), 3),
        "async_stall_over_save": round(sharded["async_stall_s"] / max(sharded["seconds"], 1e-9), 3),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
