"""The training driver: start the controller actor, pass on stop requests, show progress, return the outcome."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import ray

from vlmrun.errors import VlmrunError
from vlmrun.launch.rundir import RunDirectory
from vlmrun.train.stop import StopFlag

log = logging.getLogger(__name__)


def run_sft(rd: RunDirectory, recipe, *, attempt: int, model_dir: Path, stop: StopFlag,
            on_row: Callable[[dict], None] | None = None, worker_threads: int = 1,
            started_at: float | None = None) -> dict:
    """Run (or continue) the SFT loop of `recipe` in the Ray instance this process is connected to."""
    from vlmrun.train.controller import SftController

    controller = ray.remote(SftController).options(num_cpus=0, max_concurrency=2).remote(
        recipe_json=recipe.model_dump_json(), run_dir=str(rd.path), attempt=attempt, model_dir=str(model_dir),
        worker_threads=worker_threads, started_at=started_at)
    ref = controller.run.remote()
    follower = _RowFollower(rd.metrics_file(recipe))
    done = threading.Event()
    threading.Thread(target=_forward_stop, args=(stop, done, controller), daemon=True, name="stop-forwarder").start()
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            for row in follower.new_rows():
                if on_row:
                    on_row(row)
            if ready:
                break
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, VlmrunError):
            raise cause from None
        raise
    finally:
        done.set()


def _forward_stop(stop: StopFlag, done: threading.Event, controller) -> None:
    """Wakes as soon as the flag is set (not on a polling tick): steps can be tens of milliseconds."""
    while not done.is_set():
        if stop.wait(timeout=1.0):
            log.info("stop requested (%s): checkpointing at the next step boundary", stop.signal_name)
            controller.request_stop.remote(stop.signal_name or "signal")
            return


class _RowFollower:
    """Reads rows appended to metrics.jsonl since the last call (for the console progress line)."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), Path(path).stat().st_size if Path(path).exists() else 0

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


class ProgressLine:
    """Formats one console line per step: step, loss, tokens/s, ETA."""

    def __init__(self, max_steps: int):
        self.max_steps, self.t0, self.first = max_steps, time.time(), None

    def __call__(self, row: dict) -> str:
        step = row["step"]
        if self.first is None:
            self.first, self.t0 = step, time.time()
        done = step - self.first
        rate = (time.time() - self.t0) / done if done > 0 else row.get("step_time_s", 0.0)
        eta = max(0.0, (self.max_steps - step) * rate)
        text = (f"step {step}/{self.max_steps} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | "
                f"{row.get('tokens_per_s', 0):.0f} tok/s | ETA {_fmt(eta)}")
        if "val_accuracy" in row:
            text += (f" | val_loss {row['val_loss']:.4f} val_acc {row['val_accuracy']:.3f}"
                     f" (majority baseline {row['val_majority_baseline']:.3f})")
        return text


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
