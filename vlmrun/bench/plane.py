"""bench-plane: data-plane throughput, the wire against a plain copy, and put/get per adapter.

The batch is a GRPO step's worth of samples: prompts and responses of a few hundred tokens, 0-2
images per sample of `rows` x `dim` float32 patch rows (Qwen2.5-VL's 1176 = 3*2*14*14), rewards.

1. `wire` times encode (values -> pieces -> one jagged tensor per field: one copy) plus decode (jagged
   -> rows -> values: views) against two plain copies of the same bytes: into one new buffer per field
   (as the wire must; a fresh buffer costs page faults) and tensor by tensor (the allocator reuses
   freed buffers of the same size, so no page faults). The three run one after the other in every
   round, so `wire_over_one_buffer_copy` is the median of per-round ratios, with its spread
   (vlmrun.observe.ratios): a neighbour's load that lands in one round does not decide it.
2. Each adapter times one put of the whole batch and one get of every field of every sample per
   round; TransferQueue runs on a private local Ray (its servers and, for Mooncake, a mooncake_master
   in a free port block). Rates are medians over the rounds; MB is 1e6 bytes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.observe.ratios import ratio_spread, round_ratios

ADAPTERS = ("local", "simple", "mooncake")


def run_bench_plane(*, samples: int, rows: int, dim: int, repeats: int, adapters: list[str]) -> dict:
    """Measure the wire and every adapter in `adapters` (ADAPTERS); returns the JSON-ready result.
    Raises InputError naming --adapters for one that is not in ADAPTERS."""
    unknown = sorted(set(adapters) - set(ADAPTERS))
    if unknown or not adapters:
        raise InputError("--adapters", ",".join(adapters), f"a comma-separated subset of {','.join(ADAPTERS)}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the plane's work is a copy; one thread keeps rounds comparable
    try:
        ids, cols = make_batch(samples, rows, dim)
        report = {
            "payload_mb": round(nbytes(cols) / 1e6, 1),
            "samples": samples,
            "images": sum(len(v) for v in cols["pixel_values"]),
            "repeats": repeats,
            "wire": wire_rounds(cols, repeats),
            "adapters": {},
        }
        if "local" in adapters:
            from vlmrun.plane.local import LocalDataPlane

            report["adapters"]["local"] = bench_adapter(LocalDataPlane(), ids, cols, repeats)
        if {"simple", "mooncake"} & set(adapters):
            with tempfile.TemporaryDirectory(prefix="vlmrun-bench-plane-") as tmp:
                report["adapters"] |= bench_transfer_queue(adapters, ids, cols, repeats, Path(tmp))
    finally:
        torch.set_num_threads(threads)
    return report | {"torch_threads": 1, "cpus": os.cpu_count()}


def make_batch(samples: int, rows: int, dim: int) -> tuple[list[str], dict[str, list]]:
    import torch

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
    from vlmrun.plane.fields import field_spec
    from vlmrun.plane.wire import decode_column, encode_column, rows_of, to_jagged
    from vlmrun.plane.wire.codec import empty_row, row_numel

    for name, values in cols.items():
        spec = field_spec(name)
        pieces, tags = encode_column(spec, values)
        full = [p for p, t in zip(pieces, tags, strict=True) if row_numel(t)]
        back = iter(rows_of(to_jagged(full), len(full), name)) if full else iter(())
        decode_column(spec, [next(back) if row_numel(t) else empty_row(t) for t in tags], tags)


def tensors(values: list) -> list:
    return [t for v in values for t in (v if isinstance(v, list) else [v])]


def flat_copy(cols: dict[str, list]) -> None:
    """The same bytes copied once into one new buffer per field: the least any packing transport does."""
    import torch

    for values in cols.values():
        flat = [t.reshape(-1) for t in tensors(values)]
        if flat:
            torch.cat(flat)


def clone_copy(cols: dict[str, list]) -> None:
    """The same bytes cloned tensor by tensor (freed buffers of equal size are reused: no page faults)."""
    for values in cols.values():
        for t in tensors(values):
            t.clone()


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wire_rounds(cols: dict[str, list], repeats: int) -> dict:
    """The wire's round trip and the two plain copies, one after the other in each of `repeats` rounds
    (after one untimed round: the first allocations of each size fault their pages in)."""
    mb = nbytes(cols) / 1e6
    for warm_up in (wire_round_trip, flat_copy, clone_copy):
        warm_up(cols)
    wire, flat, clone = [], [], []
    for _ in range(repeats):
        wire.append(seconds(lambda: wire_round_trip(cols)))
        flat.append(seconds(lambda: flat_copy(cols)))
        clone.append(seconds(lambda: clone_copy(cols)))
    return {
        "encode_decode_mb_s": round(mb / statistics.median(wire), 1),
        "plain_copy_one_buffer_mb_s": round(mb / statistics.median(flat), 1),
        "plain_copy_per_tensor_mb_s": round(mb / statistics.median(clone), 1),
        "wire_over_one_buffer_copy": ratio_spread(round_ratios(wire, flat), digits=2),
    }


def bench_adapter(plane, ids: list[str], cols: dict[str, list], repeats: int) -> dict[str, float]:
    from vlmrun.algorithms.grpo.fields import partition_spec

    puts, gets = [], []
    for k in range(repeats):
        part = f"bench-{k}"
        plane.register(part, partition_spec("qwen2_5_vl", kl=True, num_samples=len(ids)))
        puts.append(seconds(lambda part=part: plane.put(part, ids, cols)))
        gets.append(seconds(lambda part=part: plane.get(part, ids, list(cols))))
        plane.clear(part)
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
