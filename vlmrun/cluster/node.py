"""The node entrypoint: what every node of a job runs (`python -m vlmrun.cluster.node --run-dir DIR`).

On the embedded default there is one node: it records the attempt in job.json, makes sure data and
model exist, starts a private Ray, runs the driver, records the outcome and exits with
0 (completed), 3 (stopped at a checkpoint, resumable), 1 (failed) or 2 (bad input).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

from vlmrun.algorithms.common.stop import StopFlag, ignore_stop_signals
from vlmrun.cluster.slurm_env import SlurmAllocation
from vlmrun.errors import EXIT_BAD_INPUT, VlmrunError
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.state import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, State

RAY_DEADLINE_S = 180.0  # every node must have joined Ray by then

log = logging.getLogger("vlmrun")


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    args = _parse(argv)
    rd = RunDirectory(args.run_dir)
    _setup_logging(os.environ.get("VLMRUN_TEE_LOG"))
    # Before any helper process starts: they inherit SIG_IGN for the stop signals (see stop.py).
    ignore_stop_signals()
    alloc = SlurmAllocation.from_env()
    if alloc is not None and alloc.node_rank != 0:
        return _serve_ray_worker(rd, alloc)  # nodes 1..N-1 join Ray and wait; only node 0 writes job.json
    job_id = alloc.job_id if alloc else f"local-{os.getpid()}"
    restart = alloc.restart_count if alloc else 0
    attempt = job_record.begin_attempt(rd, job_id, restart)
    try:
        outcome = _run(rd, attempt, job_id, started_at, alloc)
    except VlmrunError as e:
        log.error("%s", e)
        job_record.fail_attempt(rd, attempt, str(e))
        return e.exit_code
    except BaseException as e:  # noqa: BLE001 - our bug or a crash below us: record it, keep the traceback
        traceback.print_exc()
        job_record.fail_attempt(rd, attempt, f"{type(e).__name__}: {e}")
        return EXIT_FAILED
    job_record.end_attempt(rd, attempt, outcome)
    log.info("%s: %s", outcome.state, outcome.reason)
    val = outcome.final_val
    if val and val.get("val_samples"):
        log.info(
            "validation at step %d: accuracy %.3f vs majority-class baseline %.3f on %d val samples (val loss %.4f)",
            outcome.last_step,
            val["val_accuracy"],
            val["val_majority_baseline"],
            val["val_samples"],
            val["val_loss"],
        )
    return EXIT_STOPPED if outcome.state is State.STOPPED else EXIT_COMPLETED


def _serve_ray_worker(rd: RunDirectory, alloc) -> int:
    from vlmrun.cluster.ray.allocation import serve_worker
    from vlmrun.cluster.ray.local import set_local_environment

    set_local_environment()
    try:
        return serve_worker(alloc, rd.path / "ray", deadline_s=RAY_DEADLINE_S)
    except VlmrunError as e:
        log.error("%s", e)
        return e.exit_code


def _ray(job_id: str, cpus: int, alloc, rd: RunDirectory):
    """Ray for this attempt: a private local instance, or Ray across the SLURM allocation (node 0)."""
    import contextlib

    if alloc is not None:
        from vlmrun.cluster.ray.allocation import ray_head

        return ray_head(alloc, rd.path / "ray", deadline_s=RAY_DEADLINE_S)

    @contextlib.contextmanager
    def local():
        import ray

        from vlmrun.cluster.ray.local import start_local_ray

        start_local_ray(job_id, cpus)
        try:
            yield
        finally:
            ray.shutdown()

    return local()


def _run(rd: RunDirectory, attempt: int, job_id: str, started_at: float, alloc=None) -> RunOutcome:
    from vlmrun.cluster.ray.local import set_local_environment

    set_local_environment()
    from vlmrun.algorithms.sft.driver import run_sft
    from vlmrun.datasets.prepare import ensure_dataset
    from vlmrun.models.source import ensure_model
    from vlmrun.observe.progress import ProgressLine

    recipe = rd.load_recipe()
    log.info("attempt %d of %s (%s, loop %s, dp=%d)", attempt, rd.path, job_id, recipe.train.loop, recipe.parallel.dp)
    ensure_dataset(recipe.data)
    model_dir = ensure_model(recipe.model, rd.cache, recipe.train.seed)
    from vlmrun.data.components import check_components

    check_components(recipe)
    stop = StopFlag()
    cpus = max(recipe.parallel.world_size, os.cpu_count() or 1)
    with _ray(job_id, cpus, alloc, rd):
        stop.install()  # after Ray started: its processes keep SIG_IGN for the stop signals
        from vlmrun.algorithms.common.steps import plan_steps
        from vlmrun.data.splits import split_size

        # The same step count the controller uses (train.max_steps capped by epochs), so the ETA is right.
        progress = ProgressLine(plan_steps(recipe, split_size(recipe.data.path, recipe.data.split)).max_steps)
        return run_sft(
            rd,
            recipe,
            attempt=attempt,
            model_dir=model_dir,
            stop=stop,
            started_at=started_at,
            on_row=lambda row: log.info("%s", progress(row)),
        )


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m vlmrun.cluster.node", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    return p.parse_args(argv)


def _setup_logging(tee_path: str | None) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stderr)]
    if tee_path:
        handlers.append(logging.FileHandler(tee_path))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if code is not None else EXIT_BAD_INPUT)
