"""The compute limit of bench-loader: cook + encode + collate with no loader, samples in memory.

The split's tar files are read once into memory (that read is timed as the `read` stage), then
each process loops over its own stride of samples doing exactly the work of a loader worker:
cook (JSON + image decode), encode (chat template, processor), collate. With several processes
(forked, one torch thread each, like DataLoader workers) the wall time of all of them together is
the measure, and nothing travels back but timings.
"""

from __future__ import annotations

import multiprocessing
import tarfile
import time
from pathlib import Path

# Set in the parent before the pool forks, read by the children: (samples, encoder, cook, batch size).
_STATE: dict = {}


class LimitRunner:
    def __init__(self, recipe, *, processor_dir: str, processes: int):
        from vlmrun.data.chat_encoding import ConversationEncoder
        from vlmrun.data.cookers import COOK_FUNCTIONS
        from vlmrun.data.families import family_spec
        from vlmrun.data.loader import load_processor, split_shards

        d = recipe.data
        t0 = time.perf_counter()
        samples = _read_samples([Path(d.path) / name for name, _ in split_shards(d.path, d.split)])
        self._read_ms = (time.perf_counter() - t0) * 1000 / max(1, len(samples))
        encoder = ConversationEncoder(load_processor(processor_dir, recipe.family), family_spec(recipe.family),
                                      d.max_seq_len)
        self._state = {"samples": samples, "encoder": encoder, "cook": COOK_FUNCTIONS[d.cookers[0]],
                       "batch": recipe.train.micro_batch_size}
        self.processes = processes
        self._offset = 0
        self._stages = {"decode": 0.0, "processor": 0.0, "collate": 0.0}
        self._stage_samples = 0
        self._pool = None
        if processes > 1:
            _STATE.update(self._state)
            self._pool = multiprocessing.get_context("fork").Pool(processes, initializer=_init_child)

    def run(self, batches: int) -> tuple[float, list[float]]:
        """Process `batches` micro-batches; returns (wall seconds, per-batch seconds)."""
        shares = [batches // self.processes + (i < batches % self.processes) for i in range(self.processes)]
        jobs, start = [], self._offset
        for share in shares:
            jobs.append((start, share))
            start += share * self._state["batch"]
        self._offset = start
        t0 = time.perf_counter()
        if self._pool is None:
            results = [_work(job, self._state) for job in jobs]
        else:
            results = self._pool.map(_work, jobs)
        seconds = time.perf_counter() - t0
        latencies = []
        for lat, stages in results:
            latencies += lat
            for k, v in stages.items():
                self._stages[k] += v
            self._stage_samples += len(lat) * self._state["batch"]
        return seconds, latencies

    def stage_ms(self) -> dict[str, float]:
        """Mean milliseconds per sample of each stage (process time inside the workers)."""
        n = max(1, self._stage_samples)
        return {"read": round(self._read_ms, 4), **{k: round(v * 1000 / n, 4) for k, v in self._stages.items()}}

    def pids(self) -> list[int]:
        """Process ids of the worker processes (empty when the work runs in the caller's process)."""
        return [p.pid for p in self._pool._pool] if self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
        _STATE.clear()


def _init_child() -> None:
    import torch

    torch.set_num_threads(1)


def _work(job: tuple[int, int], state: dict | None = None) -> tuple[list[float], dict[str, float]]:
    state = state or _STATE
    samples, encoder, cook, size = state["samples"], state["encoder"], state["cook"], state["batch"]
    start, batches = job
    stages = {"decode": 0.0, "processor": 0.0, "collate": 0.0}
    latencies = []
    index = start
    for _ in range(batches):
        t_batch = time.perf_counter()
        encoded = []
        for _ in range(size):
            raw = samples[index % len(samples)]
            index += 1
            t0 = time.perf_counter()
            conv = cook(raw)
            t1 = time.perf_counter()
            encoded.append(encoder.encode(conv))
            t2 = time.perf_counter()
            stages["decode"] += t1 - t0
            stages["processor"] += t2 - t1
        t3 = time.perf_counter()
        encoder.collate(encoded)
        stages["collate"] += time.perf_counter() - t3
        latencies.append(time.perf_counter() - t_batch)
    return latencies, stages


def _read_samples(paths: list[Path]) -> list[dict]:
    """Every sample of the tar files as Energon hands it to a cooker (raw bytes per extension)."""
    samples: dict[str, dict] = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                sample = samples.setdefault(key, {"__key__": key, "__restore_key__": ()})
                sample[ext] = tar.extractfile(member).read()
    return list(samples.values())
