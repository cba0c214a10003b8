"""Data-plane throughput, printed as JSON: the wire against a plain copy, and put/get per adapter.

    .venv/bin/python tools/bench_plane.py [--samples 8] [--rows 1024] [--dim 1176] [--repeats 5] [--adapters local,simple,mooncake]

The batch is a GRPO step's worth of samples: prompts and responses of a few hundred tokens, 0-2
images per sample of `rows` x `dim` float32 patch rows (Qwen2.5-VL's 1176 = 3*2*14*14), rewards.
`wire` times encode (values -> pieces -> one jagged tensor per field: one copy) plus decode (jagged ->
rows -> values: views) against two plain copies of the same bytes: into one new buffer per field (as
the wire must; a fresh buffer costs page faults) and tensor by tensor (the allocator reuses freed
buffers of the same size, so no page faults). Each adapter times one put of the whole batch and one get
of every field of every sample; TransferQueue runs on a private local Ray (its servers and, for
Mooncake, a mooncake_master in a free port block). Medians over `repeats`; MB is 1e6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from vlmrun.plane.fields import Stage, field_spec
from vlmrun.plane.interface import PartitionSpec
from vlmrun.plane.wire import decode_column, encode_column, rows_of, to_jagged
from vlmrun.plane.wire.codec import empty_row, row_numel

CONSUMERS = (Stage.PREV_LOGPROB, Stage.REF_LOGPROB, Stage.ADVANTAGE, Stage.TRAIN)


def make_batch(samples: int, rows: int, dim: int) -> tuple[list[str], dict[str, list]]:
    gen = torch.Generator().manual_seed(0)
    cols: dict[str, list] = {k: [] for k in ("prompt_ids", "mm_token_type_ids", "response_ids", "response_mask")}
    cols |= {"generation_logprobs": [], "rewards": [], "pixel_values": [], "image_grid_thw": []}
    for i in range(samples):
        n_prompt, n_resp, images = 200 + 13 * i, 100 + 7 * i, i % 3
        cols["prompt_ids"].append(torch.randint(0, 150000, (n_prompt,), generator=gen))
        cols["mm_token_type_ids"].append(torch.zeros(n_prompt, dtype=torch.long))
        cols["response_ids"].append(torch.randint(0, 150000, (n_resp,), generator=gen))
        cols["response_mask"].append(torch.ones(n_resp, dtype=torch.bool))
        cols["generation_logprobs"].append(-torch.rand(n_resp, generator=gen))
        cols["rewards"].append(torch.tensor(float(i % 2)))
        cols["pixel_values"].append([torch.randn(rows, dim, generator=gen) for _ in range(images)])
        cols["image_grid_thw"].append([torch.tensor([[1, 32, rows // 32]] * images)] if images else [])
    return [f"s{i}" for i in range(samples)], cols


def nbytes(cols: dict[str, list]) -> int:
    def size(v):
        return sum(size(x) for x in v) if isinstance(v, list) else v.numel() * v.element_size()

    return sum(size(v) for v in cols.values())


def wire_round_trip(cols: dict[str, list]) -> None:
    for name, values in cols.items():
        spec = field_spec(name)
        pieces, tags = encode_column(spec, values)
        full = [p for p, t in zip(pieces, tags, strict=True) if row_numel(t)]
        back = iter(rows_of(to_jagged(full), len(full), name)) if full else iter(())
        decode_column(spec, [next(back) if row_numel(t) else empty_row(t) for t in tags], tags)


def tensors(values: list) -> list[torch.Tensor]:
    return [t for v in values for t in (v if isinstance(v, list) else [v])]


def flat_copy(cols: dict[str, list]) -> None:
    """The same bytes copied once into one new buffer per field: the least any packing transport does."""
    for values in cols.values():
        flat = [t.reshape(-1) for t in tensors(values)]
        if flat:
            torch.cat(flat)


def clone_copy(cols: dict[str, list]) -> None:
    """The same bytes cloned tensor by tensor (freed buffers of equal size are reused: no page faults)."""
    for values in cols.values():
        for t in tensors(values):
            t.clone()


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_adapter(plane, ids: list[str], cols: dict[str, list], repeats: int) -> dict[str, float]:
    puts, gets = [], []
    for k in range(repeats):
        part = f"bench-{k}"
        plane.register(part, PartitionSpec.for_stages("qwen2_5_vl", CONSUMERS, len(ids)))
        t0 = time.perf_counter()
        plane.put(part, ids, cols)
        t1 = time.perf_counter()
        plane.get(part, ids, list(cols))
        t2 = time.perf_counter()
        plane.clear(part)
        puts.append(t1 - t0)
        gets.append(t2 - t1)
    mb = nbytes(cols) / 1e6
    return {"put_mb_s": round(mb / statistics.median(puts), 1), "get_mb_s": round(mb / statistics.median(gets), 1)}


def bench_transfer_queue(adapters: list[str], ids, cols, repeats: int, tmp: Path) -> dict[str, dict]:
    from vlmrun.cluster.mooncake import mooncake_ports, mooncake_unavailable, running_mooncake_master
    from vlmrun.cluster.ray.local import start_local_ray
    from vlmrun.cluster.ray.nodes import port_block, taken_ports
    from vlmrun.plane.transfer_queue.servers import start_transfer_queue, stop_transfer_queue
    from vlmrun.plane.transfer_queue.store import TransferQueuePlane

    out = {}
    start_local_ray(f"bench-plane-{os.getpid()}", 2)  # sets Ray's loopback environment before Ray is imported
    import ray

    try:
        if "simple" in adapters:
            servers = start_transfer_queue("simple")
            plane = TransferQueuePlane(servers.endpoint)
            out["transfer_queue/simple"] = bench_adapter(plane, ids, cols, repeats)
            plane.close()
            stop_transfer_queue(servers)
        if "mooncake" in adapters and mooncake_unavailable():
            out["transfer_queue/mooncake"] = {"skipped": mooncake_unavailable()}
        elif "mooncake" in adapters:
            block = next(
                b
                for b in (port_block(str(os.getpid() + k)) for k in range(100))
                if not taken_ports("127.0.0.1", mooncake_ports(b).all())
            )
            segment = 2 * nbytes(cols) + (64 << 20)
            with running_mooncake_master(block, host="127.0.0.1", log_path=tmp / "mooncake-master.log") as master:
                servers = start_transfer_queue("mooncake", mooncake=master.store_config(segment_bytes=segment))
                plane = TransferQueuePlane(servers.endpoint)
                out["transfer_queue/mooncake"] = bench_adapter(plane, ids, cols, repeats)
                plane.close()
                stop_transfer_queue(servers)
    finally:
        ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--dim", type=int, default=1176)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--adapters", default="local,simple,mooncake")
    args = p.parse_args(argv)
    adapters = args.adapters.split(",")
    torch.set_num_threads(1)
    ids, cols = make_batch(args.samples, args.rows, args.dim)
    mb = nbytes(cols) / 1e6
    wire_s = median_s(lambda: wire_round_trip(cols), args.repeats)
    flat_s, clone_s = median_s(lambda: flat_copy(cols), args.repeats), median_s(lambda: clone_copy(cols), args.repeats)
    report = {
        "payload_mb": round(mb, 1),
        "samples": args.samples,
        "images": sum(len(v) for v in cols["pixel_values"]),
        "wire": {
            "encode_decode_mb_s": round(mb / wire_s, 1),
            "plain_copy_one_buffer_mb_s": round(mb / flat_s, 1),
            "plain_copy_per_tensor_mb_s": round(mb / clone_s, 1),
            "wire_s_over_one_buffer_copy_s": round(wire_s / flat_s, 2),
        },
        "adapters": {},
    }
    if "local" in adapters:
        from vlmrun.plane.local import LocalDataPlane

        report["adapters"]["local"] = bench_adapter(LocalDataPlane(), ids, cols, args.repeats)
    if {"simple", "mooncake"} & set(adapters):
        with tempfile.TemporaryDirectory() as tmp:
            report["adapters"] |= bench_transfer_queue(adapters, ids, cols, args.repeats, Path(tmp))
    report["torch_threads"] = torch.get_num_threads()
    report["cpus"] = os.cpu_count()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
