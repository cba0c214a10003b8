"""`vlmrun submit`: validate the recipe, then hand the run to the executor the user chose.

A submit that fails before job.json records its job (sbatch refused it, the controller went away,
the node could not start) leaves no trace: what it made in the run dir is removed, and a run dir it
created goes. (A run dir that an older version left that way, recipe.yaml without job.json, is
refused here like any run; `vlmrun status` and `vlmrun resume` know it as never submitted.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from vlmrun.checkpoint.store import CheckpointStore, run_checkpoints
from vlmrun.cluster.preflight import preflight_run
from vlmrun.errors import InputError
from vlmrun.launch.data_check import check_data_at_submit
from vlmrun.launch.result import SubmitResult
from vlmrun.launch.step_plan import plan_at_submit
from vlmrun.launch.targets import resolve_cluster
from vlmrun.models.fit import check_memory_fit
from vlmrun.run.directory import RunDirectory, check_recipe, default_run_dir
from vlmrun.run.lock import RunLocked, live_holder


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
    missing model or data set, too few GPUs on this machine for a local run (cluster/preflight.py), a
    GPU recipe whose memory estimate exceeds cluster.gpu_memory_gb (models/fit.py), a checkpoint.dir
    that belongs to another run (vlmrun/checkpoint/owner.py), a prepared data set whose samples
    the run would stop on (launch/data_check.py), or a SLURM whose controller
    does not answer (a dry run then shows the SLURM job and says so through `echo`). The estimate rides on the result (`memory`); its warning (within 10% of the
    limit) goes to `echo` before a run.
    """
    from vlmrun.config.load import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    check_recipe(recipe)  # before the lock makes the run dir: a refused recipe leaves nothing behind
    executor = resolve_cluster(cluster, dry_run=dry_run, echo=echo)
    rd = RunDirectory(run_dir or default_run_dir(recipe.name))
    if (holder := live_holder(rd.path)) is not None:
        raise RunLocked(rd.path, holder)
    if rd.exists():
        raise InputError(
            "--run-dir",
            str(rd.path),
            f"already holds a run{'' if rd.job_file.exists() else ' (never submitted: no job.json)'}; "
            f"continue it with `vlmrun resume {rd.path}` or choose another --run-dir",
        )
    memory = check_memory_fit(recipe)  # before preflight: a layout that cannot fit, wherever the weights are
    preflight_run(recipe, runs_here=executor.runs_here, dry_run=dry_run)  # a submit's errors (weights aside)
    check_data_at_submit(recipe, echo=echo)  # a prepared set's samples against the recipe (cached)
    steps = plan_at_submit(recipe)
    if steps is not None and steps.capped and echo is not None:
        echo(f"note: {steps.cap_advice()}")
    checkpoints = run_checkpoints(rd, recipe)  # with the id this submit gives the run
    checkpoints.check_owner()
    if dry_run:
        result = executor.dry_run(rd, recipe, echo=echo)
    else:
        if memory.warning and echo is not None:
            echo(f"warning: {memory.warning}")
        with _claimed(checkpoints, rd, explicit=recipe.checkpoint.dir is not None), _undone_unless_recorded(rd):
            result = executor.submit(rd, recipe, wait=wait, echo=echo)
    result.memory, result.steps = memory, steps
    return result


@contextlib.contextmanager
def _undone_unless_recorded(rd: RunDirectory):
    """Removes what the block wrote into `rd` (all of `rd` when it made it) when the block fails
    before job.json exists: no job was recorded, so nothing may refer to the run dir. Once job.json
    records a job, a failure leaves everything in place: the job may have begun, and what it wrote
    (checkpoints, metrics, logs) is the user's."""
    existed = rd.path.exists()
    before = set(os.listdir(rd.path)) if existed else set()
    try:
        yield
    except BaseException:
        if rd.job_file.exists():
            raise
        if not existed:
            shutil.rmtree(rd.path, ignore_errors=True)
        else:
            for name in set(os.listdir(rd.path)) - before:
                path = rd.path / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _claimed(checkpoints: CheckpointStore, rd: RunDirectory, *, explicit: bool) -> Iterator[None]:
    """An explicit checkpoint.dir is claimed for the new run before its run directory is made, so that of
    two submits at once onto one folder exactly one goes ahead (the other: exit 2 naming the winner).
    When the block fails before the run directory came to be, the claim, and a folder it made, go
    again. The default folder, inside the new run directory, is claimed by the run's job."""
    if not explicit:
        yield
        return
    made = not checkpoints.root.exists()
    checkpoints.claim()
    try:
        yield
    except BaseException:
        if not rd.exists():
            checkpoints.release_claim()
            if made:
                with contextlib.suppress(OSError):
                    checkpoints.root.rmdir()
        raise
