"""`vlmrun resume`: continue an ended run from its newest complete checkpoint, as a new attempt.

1. `--set` may change only RESUMABLE fields (step budget, validation and checkpoint cadence, where the
   checkpoints are, cluster, logger); anything else is refused before anything starts, naming the
   field. checkpoint.dir takes a folder of this run's checkpoints (moved, or copied for a copied run
   directory: vlmrun/checkpoint/copies.py); one without any trains from step 0. With
   `--restart-data-order`, parallel.dp too: the job then takes the model, optimizer and counters from
   a checkpoint of another dp (DCP reshards a sharded one) and starts the data order over.
2. Whatever changed the recipe (`--set`, or an edited recipe.yaml), the fields that define the run
   (config/identity.py: batch sizes, layout, seed, data and splits, sequence length, loop, algorithm,
   model, and what model.path holds) must equal those the newest checkpoint recorded, or the resume
   is refused listing each `field: old -> new`. The job repeats the check against the checkpoint it
   verified. A checkpoint folder that belongs to another run is refused too (vlmrun/checkpoint/owner.py),
   and so is a copied run directory's checkpoint.dir that is the original's own folder.
3. A COMPLETED run whose newest valid checkpoint reached its planned steps has nothing to do: said,
   exit 0, nothing started or recorded. That checkpoint is verified here (a full read, on this rare
   path only): a damaged final checkpoint must be trained again, not reported as done.
4. The new attempt runs where the run ran (job.json's `cluster`, launch/executor.py). A run dir
   that was never submitted (no job.json) runs where `submit --cluster auto` would put it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlmrun.checkpoint.copies import original_of
from vlmrun.checkpoint.store import run_checkpoints
from vlmrun.cluster.preflight import preflight_run
from vlmrun.config.identity import RESHARD_TERMS, RESHARDABLE, check_same_identity, run_identity
from vlmrun.errors import InputError
from vlmrun.launch.result import SubmitResult
from vlmrun.launch.targets import executor_of, find_run, resolve_cluster
from vlmrun.models.fingerprint import model_contents
from vlmrun.run import job as job_record
from vlmrun.run.directory import check_recipe, dump_recipe, write_atomic
from vlmrun.run.lock import RunLock, RunLocked, live_holder
from vlmrun.run.state import State

# Fields a resume may change: none of them changes which samples a step sees or where ranks sit.
RESUMABLE = (
    "train.max_steps",
    "train.epochs",
    "train.val_period",
    "train.val_samples",
    "train.stop_after",
    "checkpoint.dir",
    "checkpoint.save_period",
    "checkpoint.keep",
    "checkpoint.requeue",
    "checkpoint.async_save",
    "cluster",
    "logger",
)


def resume_run(
    target: str,
    overrides: list[str],
    *,
    wait: bool,
    restart_data_order: bool = False,
    echo: Callable[[str], None] | None = None,
):
    from vlmrun.config.load import parse_override, set_dotted, validate

    rd, last_job = find_run(target)
    job = job_record.read_job(rd)
    if job is not None:
        executor_of(job).refuse_while_live(rd, job, last_job, target)
    if (holder := live_holder(rd.path)) is not None:
        raise RunLocked(rd.path, holder)
    raw = rd.recipe_data()
    stopped_after = (raw.get("train") or {}).get("stop_after")
    was_restarting = bool((raw.get("checkpoint") or {}).get("restart_data_order", False))
    resumable = RESUMABLE + (RESHARDABLE if restart_data_order else ())
    set_dotted(raw, "train.stop_after", None)  # for one attempt only: this one stops where its --set says
    for item in overrides:
        key, value = parse_override(item)
        if key in RESHARDABLE and not restart_data_order:
            raise InputError(
                key,
                value,
                message=f"{key}: {value}: a resume at another dp would {RESHARD_TERMS}; "
                "pass --restart-data-order to accept that",
            )
        if not any(key == p or key.startswith(p + ".") for p in resumable):
            raise InputError(
                key,
                value,
                "changing it would change the sample stream or placement the checkpoint "
                f"belongs to; a resume may change {', '.join(resumable)}",
            )
        if key == "checkpoint.dir" and isinstance(value, str):  # as submit has it: absolute
            value = str(Path(value).expanduser().resolve())
        set_dotted(raw, key, value)
    set_dotted(raw, "checkpoint.restart_data_order", restart_data_order)  # for this attempt only
    recipe = validate(raw)
    check_recipe(recipe)
    check_resumable(rd, recipe)
    if job is not None and job.state is State.COMPLETED and (done := _nothing_left(rd, recipe)) is not None:
        if echo:
            echo(
                f"{rd.path} completed all {done} steps: nothing to do; raise train.max_steps (or train.epochs) to train on"
            )
        return SubmitResult(rd.path, job.cluster, False, job_id=last_job, state=State.COMPLETED.value)
    executor = executor_of(job) if job is not None else _unsubmitted_executor(rd)
    preflight_run(recipe, runs_here=executor.runs_here)
    lock = RunLock.acquire(rd.path)  # before our first write: one attempt per run dir (exit 2 naming the holder)
    try:
        if overrides or restart_data_order != was_restarting or stopped_after is not None:
            write_atomic(rd.recipe_file, dump_recipe(recipe))
        return executor.resume(rd, recipe, wait=wait, lock=lock, echo=echo)
    except BaseException:
        lock.release()
        raise


def _unsubmitted_executor(rd):
    """Where a run dir that was never submitted (no job.json) runs: where `submit --cluster auto` would."""
    try:
        return resolve_cluster("auto")
    except InputError as e:
        raise InputError(
            "RUN_DIR",
            str(rd.path),
            message=f"{rd.path} was never submitted (no job.json), so it runs where --cluster auto puts it: {e}; "
            f"to run it on this machine, submit its recipe anew: vlmrun submit {rd.recipe_file} --cluster local",
        ) from None


def check_resumable(rd, recipe) -> None:
    """Refuse (InputError, exit 2) a recipe that no longer defines the run its newest checkpoint belongs
    to, whatever changed it (`--set` or an edited recipe.yaml), or what model.path holds; a checkpoint
    folder that is another run's; and a copied run directory whose checkpoint.dir is the original's
    (vlmrun/checkpoint/copies.py). The job checks again at its start."""
    original_of(rd, recipe)
    store = run_checkpoints(rd, recipe, assign=False)
    store.check_owner()
    newest = store.newest_manifest()
    if newest is not None:
        step, manifest = newest
        ignore = RESHARDABLE if recipe.checkpoint.restart_data_order else ()
        current = run_identity(recipe, model_contents=model_contents(recipe.model))
        check_same_identity(manifest.identity, current, where=f"the checkpoint of step {step}", ignore=ignore)


def _nothing_left(rd, recipe) -> int | None:
    """The run's planned step count when its newest valid checkpoint already reached it, else None."""
    from vlmrun.algorithms.common.steps import plan_steps
    from vlmrun.data.splits import split_size

    found, _ = run_checkpoints(rd, recipe, assign=False).latest()
    try:
        planned = plan_steps(recipe, split_size(recipe.data.path, recipe.data.split)).max_steps
    except InputError:  # the data set is gone: the job would say so; count on train.max_steps
        planned = recipe.train.max_steps
    return planned if found is not None and found.step >= planned else None
