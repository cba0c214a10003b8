"""`vlmrun submit`: validate the recipe, then hand the run to the executor the user chose."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from vlmrun.cluster.preflight import preflight_run
from vlmrun.errors import InputError
from vlmrun.launch.result import SubmitResult
from vlmrun.models.fit import check_memory_fit
from vlmrun.run.directory import RunDirectory, check_recipe, default_run_dir, dump_recipe
from vlmrun.run.lock import RunLock, RunLocked, live_holder

CLUSTERS = ("auto", "slurm", "local")


def resolve_cluster(cluster: str) -> str:
    if cluster not in CLUSTERS:
        raise InputError("--cluster", cluster, f"choose one of {', '.join(CLUSTERS)}")
    if cluster == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    return cluster


def submit_run(
    recipe_path: Path,
    overrides: list[str],
    *,
    cluster: str = "auto",
    run_dir: Path | None = None,
    dry_run: bool = False,
    wait: bool = False,
    echo: Callable[[str], None] | None = None,
) -> SubmitResult:
    """Validate everything first, so a bad recipe or argument starts and submits nothing.

    Raises InputError (before a run dir is created or data generated) for a bad recipe, argument, a
    missing model or data set, too few GPUs on this machine for a local run (cluster/preflight.py), or
    a GPU recipe whose memory estimate exceeds cluster.gpu_memory_gb (models/fit.py). The estimate
    rides on the result (`memory`); its warning (within 10% of the limit) goes to `echo` before a run.
    """
    from vlmrun.config.load import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    check_recipe(recipe)  # before the lock makes the run dir: a refused recipe leaves nothing behind
    chosen = resolve_cluster(cluster)
    rd = RunDirectory(run_dir or default_run_dir(recipe.name))
    if (holder := live_holder(rd.path)) is not None:
        raise RunLocked(rd.path, holder)
    if rd.exists():
        raise InputError(
            "--run-dir",
            str(rd.path),
            f"already holds a run; continue it with `vlmrun resume {rd.path}` or choose another --run-dir",
        )
    memory = check_memory_fit(recipe)  # before preflight: a layout that cannot fit, wherever the weights are
    preflight_run(recipe, runs_here=chosen == "local", dry_run=dry_run)  # a submit's errors (weights aside)
    if memory.warning and echo is not None and not dry_run:
        echo(f"warning: {memory.warning}")
    if chosen == "slurm":
        from vlmrun.launch.slurm.submit import submit_slurm

        result = submit_slurm(rd, recipe, dry_run=dry_run, wait=wait, echo=echo)
        if dry_run:
            result.script, result.rendered = result.rendered, dump_recipe(recipe)
        result.memory = memory
        return result
    if dry_run:
        return SubmitResult(rd.path, chosen, True, rendered=dump_recipe(recipe), memory=memory)
    from vlmrun.launch.local import start_local

    lock = RunLock.acquire(rd.path)  # before our first write: one attempt per run dir (exit 2 naming the holder)
    try:
        rd.create(recipe)
    except BaseException:
        lock.release()
        raise
    result = start_local(rd, recipe, wait=wait, lock=lock, echo=echo)
    result.memory = memory
    return result
