"""bench-loader: the Energon loader side by side with the reference loader and the compute limit.

Three kinds of rows, each for every requested worker count:

1. `energon`: a `LoaderShard` (shard 0 of 1), exactly what training uses.
2. `reference`: `vlmrun.bench.reference` (plain WebDataset + torch DataLoader), same cooker and encoder.
3. `limit`: the same cook + encode + collate on samples already in memory, no loader
   (`vlmrun.bench.limit`): in the caller with 0 workers, with its per-sample cost broken into
   stages (read, decode, processor, collate); in k processes delivering to the caller otherwise.

Measurements interleave: every row runs one chunk per round, in an order that rotates, so a noisy
neighbour on a shared machine hits all of them alike. A row's rate is the median of its chunks'
rates (samples over seconds); `samples_per_s_iqr` gives the quartiles of the chunk rates, the spread
the noise left. The ratios compare the best worker count of each kind (by that median) round by
round: each round's ratio divides two chunks measured seconds apart, and `ratio_energon_vs_*` is the
median of those per-round ratios, with their spread in `ratio_spread` (vlmrun.observe.ratios), so
load from elsewhere that comes and goes moves the spread, not the median. Batch latency percentiles
are over all timed micro-batches (a row with workers hands out a transfer group at once, so its p50
is ~0). Results are plain JSON (the CLI prints a table or `--json`).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.observe.ratios import ratio_spread, round_ratios

TARGET_VS_REFERENCE = 1.1
TARGET_VS_LIMIT = 0.8
BENCH_IMAGE_SIZE = 224
_WARMUP_BATCHES = 8
_CHUNK_BATCHES = 60
# After a row with workers, they refill their prefetch queues (bounded work); let that finish
# before timing the next row, so one row's background work is not charged to another.
_SETTLE_S = 0.2


def bench_recipe(
    recipe_path: Path, overrides: list[str], *, workers: str, batches: int, image_size: int | None, bar: bool
) -> dict:
    """`vlmrun bench-loader`: `run_bench` on the recipe at `recipe_path` with `overrides`, `workers` as
    the comma-separated text the user gave (InputError naming --workers when it is not), with a
    progress bar when `bar`. Energon prints a line to stdout for every sample it skips; during the run
    (and in the workers forked during it) stdout goes to stderr, so stdout carries only the result."""
    import contextlib
    import sys

    from vlmrun.config.load import load_recipe
    from vlmrun.observe.progress import progress_bar

    try:
        counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        raise InputError("--workers", workers, "a comma-separated list of integers, e.g. 0,1,2") from None
    loaded = load_recipe(recipe_path, overrides)
    with progress_bar("measuring loaders", enabled=bar) as progress, contextlib.redirect_stdout(sys.stderr):
        return run_bench(loaded, workers=counts, batches=batches, image_size=image_size, progress=progress)


def run_bench(
    recipe,
    *,
    workers: list[int] = (0, 1, 2),
    batches: int = 600,
    image_size: int | None = None,
    rounds: int | None = None,
    processor_dir: str | None = None,
    progress=None,
) -> dict:
    """Measure the three loaders on `recipe` (see module doc); returns the JSON-ready result dict.

    `batches` is the number of measured micro-batches per row, spread over `rounds` chunks
    (default: one per ~60 batches). Before each timed chunk a row first takes the micro-batches its
    workers prefetched while it was not measured. The data set is the recipe's, regenerated at
    `image_size` (default 224) next to it when it is synthetic. `processor_dir` defaults to the
    recipe's model (a tiny one is built in the user cache, $XDG_CACHE_HOME/vlmrun). `progress(done, total)` is
    called after each timed chunk. Raises `InputError` for a bad worker list or batch count.
    """
    workers = sorted(set(workers))
    if not workers or min(workers) < 0:
        raise InputError("--workers", workers, "a comma-separated list of worker counts >= 0, e.g. 0,1,2")
    rounds = rounds or max(2, batches // _CHUNK_BATCHES)
    if batches < rounds:
        raise InputError("--batches", batches, f"at least {rounds}")
    data_path, size = bench_dataset(recipe, image_size)
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"path": str(data_path)})})
    processor_dir = processor_dir or _processor_dir(recipe)
    import torch

    threads = torch.get_num_threads()
    # In-process rows would otherwise time torch's intra-op threads fighting the loader workers for
    # the same cores (100 ms stalls on the 2-CPU dev box); DataLoader workers use one thread too.
    torch.set_num_threads(1)
    from vlmrun.data.malloc import retain_freed_memory

    # Every row runs in this process or in workers forked from it, under the malloc settings the
    # Energon loader applies where it runs in training: set once, before any row, so no row's
    # speed depends on what the rows before it allocated (see vlmrun.data.malloc).
    retain_freed_memory()
    runners = _open_runners(recipe, processor_dir, workers)
    try:
        for runner in runners:
            runner.warm_up(_WARMUP_BATCHES)
        _measure_interleaved(runners, batches // rounds, rounds, progress)
        rows = [runner.row() for runner in runners]
    finally:
        for runner in runners:
            runner.close()
        torch.set_num_threads(threads)
    return _summary(recipe, data_path, size, workers, batches, rounds, rows)


def _measure_interleaved(runners: list, chunk: int, rounds: int, progress) -> None:
    """Every row measures one chunk per round; the order rotates so no row always follows another."""
    done, previous = 0, None
    for r in range(rounds):
        for runner in runners[r % len(runners) :] + runners[: r % len(runners)]:
            if previous is not None and previous.num_workers:
                time.sleep(_SETTLE_S)
            runner.drain()
            runner.measure(chunk)
            previous = runner
            done += 1
            if progress is not None:
                progress(done, rounds * len(runners))


def bench_dataset(recipe, image_size: int | None) -> tuple[Path, int | None]:
    """The data set to measure on: for a synthetic recipe, its twin at `image_size` (default 224)."""
    d = recipe.data
    if d.synthetic is None:
        if image_size is not None:
            raise InputError("--image-size", image_size, "only for recipes with data.synthetic (the set is generated)")
        return Path(d.path), None
    from vlmrun.datasets.clevr import ensure_clevr

    s = d.synthetic
    size = image_size or BENCH_IMAGE_SIZE
    path = Path(d.path) if size == s.image_size else Path(f"{d.path}-{size}")
    ensure_clevr(path, train=s.train, val=s.val, image_size=size, seed=s.seed)
    return path, size


def _processor_dir(recipe) -> str:
    """The recipe's model directory; a tiny one is built in the user cache, never beside the user's data."""
    from vlmrun.data.check import cache_dir
    from vlmrun.models.source import ensure_model

    return str(ensure_model(recipe.model, cache_dir(), recipe.train.seed))


def _open_runners(recipe, processor_dir: str, workers: list[int]) -> list:
    runners = []
    for kind in ("energon", "reference", "limit"):
        for k in workers:
            runners.append(_Runner(kind, k, recipe, processor_dir))
    return runners


class _Runner:
    """One row: a loader kind at one worker count, measured chunk by chunk."""

    def __init__(self, kind: str, num_workers: int, recipe, processor_dir: str):
        self.kind, self.num_workers = kind, num_workers
        self.micro_batch_size = recipe.train.micro_batch_size
        self.bytes_per_sample = _bytes_per_sample(recipe.data.path, recipe.data.split)
        self.latencies: list[float] = []
        self.chunk_rates: list[float] = []
        self.peak_rss_mb = 0.0
        self.worker_rss_mb: dict[int, float] = {}
        self.worker_uss_mb: dict[int, float] = {}
        from vlmrun.data.transport import transfer_group

        self._before: set[int] = set()
        group = 1 if kind == "reference" else transfer_group(self.micro_batch_size, recipe.data.transfer_samples)
        # torch's DataLoader keeps prefetch_factor (2) items per worker; an item is `group` micro-batches
        self.prefetch_depth = 2 * num_workers * group
        self._limit = None
        self._shard = None
        r = recipe.model_copy(update={"data": recipe.data.model_copy(update={"num_workers": num_workers})})
        if kind == "energon":
            from vlmrun.data.loader import open_loader_shard

            self._shard = open_loader_shard(
                r, processor_dir=processor_dir, shard=0, num_shards=1, placement_hash="bench", split=r.data.split
            )
            self._next = self._shard.next_batch
        elif kind == "reference":
            from vlmrun.bench.reference import reference_loader

            iterator = reference_loader(r, processor_dir=processor_dir, split=r.data.split, num_workers=num_workers)
            self._next = iterator.__next__
            self._iterator = iterator
        else:
            from vlmrun.bench.limit import LimitRunner

            self._limit = LimitRunner(r, processor_dir=processor_dir, num_workers=num_workers)
            self._next = self._limit.next_batch

    def drain(self) -> None:
        """Take, untimed, what the workers prefetched since this row was last measured, then as
        much again while they work: the chunk starts in the steady state (every worker busy, the
        queue as full as it runs), not from an idle pipeline whose first groups are still being
        made, which would charge each chunk the pipeline's fill time."""
        for _ in range(2 * self.prefetch_depth):
            self._next()

    def warm_up(self, n: int) -> None:
        self._before = _child_pids()
        for _ in range(n):
            self._next()
        self._workers = sorted(_child_pids() - self._before)

    def measure(self, n: int) -> None:
        latencies = []
        start = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            self._next()
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - start
        self.chunk_rates.append(n * self.micro_batch_size / seconds)
        self.latencies += latencies
        self._sample_rss()

    def _sample_rss(self) -> None:
        """RSS (what `top` shows; counts pages shared with the parent) and USS (this process's own)."""
        import psutil

        pids = self._workers if self.num_workers and self._workers else [os.getpid()]
        for i, pid in enumerate(pids):
            try:
                memory = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue
            rss, uss = memory.rss / 2**20, memory.uss / 2**20
            self.worker_rss_mb[i] = max(self.worker_rss_mb.get(i, 0.0), round(rss, 1))
            self.worker_uss_mb[i] = max(self.worker_uss_mb.get(i, 0.0), round(uss, 1))
            self.peak_rss_mb = max(self.peak_rss_mb, round(rss, 1))

    def row(self) -> dict:
        sps = statistics.median(self.chunk_rates) if self.chunk_rates else 0.0
        quartiles = statistics.quantiles(self.chunk_rates, n=4) if len(self.chunk_rates) > 1 else [sps] * 3
        ms = sorted(x * 1000 for x in self.latencies)
        row = {
            "loader": self.kind,
            "num_workers": self.num_workers,
            "samples_per_s": round(sps, 1),
            "samples_per_s_iqr": [round(quartiles[0], 1), round(quartiles[2], 1)],
            "chunk_samples_per_s": [round(x, 1) for x in self.chunk_rates],  # one per round, in round order
            "mb_per_s": round(sps * self.bytes_per_sample / 1e6, 2),
            "p50_batch_ms": round(statistics.median(ms), 3) if ms else None,
            "p95_batch_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 3) if ms else None,
            "measured_batches": len(self.latencies),
            "stage_ms_per_sample": self._limit.stage_ms() if self._limit is not None else None,
            "peak_rss_mb": self.peak_rss_mb,
            "rss_per_worker_mb": list(self.worker_rss_mb.values()) if self.num_workers else [],
            "uss_per_worker_mb": list(self.worker_uss_mb.values()) if self.num_workers else [],
        }
        return row

    def close(self) -> None:
        if self._shard is not None:
            self._shard.close()
        if self._limit is not None:
            self._limit.close()
        if self.kind == "reference":
            self._iterator.close()


def _summary(recipe, data_path: Path, size, workers, batches, rounds, rows) -> dict:
    best, top = {}, {}
    for kind in ("energon", "reference", "limit"):
        top[kind] = max((r for r in rows if r["loader"] == kind), key=lambda r: r["samples_per_s"])
        best[kind] = {"num_workers": top[kind]["num_workers"], "samples_per_s": top[kind]["samples_per_s"]}
    spread = {
        f"energon_vs_{kind}": ratio_spread(
            round_ratios(top["energon"]["chunk_samples_per_s"], top[kind]["chunk_samples_per_s"])
        )
        for kind in ("reference", "limit")
    }
    vs_ref = spread["energon_vs_reference"]["median"] or 0.0
    vs_limit = spread["energon_vs_limit"]["median"] or 0.0
    return {
        "recipe": recipe.name,
        "family": recipe.family,
        "dataset": str(data_path),
        "split": recipe.data.split,
        "image_size": size,
        "micro_batch_size": recipe.train.micro_batch_size,
        "workers": list(workers),
        "batches": batches,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "results": rows,
        "best": best,
        "ratio_energon_vs_reference": vs_ref,
        "ratio_energon_vs_limit": vs_limit,
        "ratio_spread": spread,
        "target": {"energon_vs_reference": TARGET_VS_REFERENCE, "energon_vs_limit": TARGET_VS_LIMIT},
        "definitions": {
            "energon": "vlmrun LoaderShard (Energon savable loader, shard 0 of 1), as in training",
            "reference": "WebDataset + torch DataLoader, same cooker and encoder, one micro-batch per item",
            "limit": "samples in memory, cook+encode+collate, no loader; with k workers k processes "
            "delivering to the caller like the Energon shard",
            "ratios": "the best rows' chunk rates divided round by round; the median of those, spread in ratio_spread",
        },
        "target_met": bool(vs_ref >= TARGET_VS_REFERENCE and vs_limit >= TARGET_VS_LIMIT),
    }


def _bytes_per_sample(path: str, split: str) -> float:
    from vlmrun.data.splits import split_shards

    shards = split_shards(path, split)
    total = sum((Path(path) / name).stat().st_size for name, _ in shards)
    return total / max(1, sum(count for _, count in shards))


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=False)}
