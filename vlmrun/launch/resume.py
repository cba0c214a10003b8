"""`vlmrun resume`: continue an ended run from its newest complete checkpoint, as a new attempt.

1. `--set` may change only RESUMABLE fields (step budget, validation and checkpoint cadence, where the
   checkpoints are, cluster, logger, the memory knobs of generation, and the recovery steps for bad
   samples); anything else is refused before anything starts, naming the field and why. What a resume
   changes is said and recorded: the attempt it starts lists it in job.json (`resumed_with`).
   checkpoint.dir takes a folder of this run's checkpoints (moved, or copied for a copied run
   directory: vlmrun/checkpoint/copies.py); one without any trains from step 0. With
   `--restart-data-order`, parallel.dp (and, on the megatron backend, parallel.tp and parallel.pp) too:
   the job then takes the model, optimizer and counters from a checkpoint of another layout (DCP
   reshards a sharded one; the megatron backend's pieces of HF tensors read into any tp x pp) and
   starts the data order over.
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
from vlmrun.config.identity import (
    RELAYOUT_TERMS,
    RELAYOUTABLE,
    RESHARD_TERMS,
    RESHARDABLE,
    check_same_identity,
    run_identity,
)
from vlmrun.errors import InputError
from vlmrun.launch.result import SubmitResult
from vlmrun.launch.targets import executor_of, find_run, resolve_cluster
from vlmrun.models.fingerprint import model_contents
from vlmrun.run import job as job_record
from vlmrun.run.directory import check_recipe, dump_recipe, write_atomic
from vlmrun.run.lock import RunLock, RunLocked, live_holder
from vlmrun.run.state import State

#: Fields a resume may change, and what a change does: none changes which samples a step sees or where
#: ranks sit (a recovery step at most skips a sample the run could not train on, and counts it).
#: `vlmrun resume --help` and the README list them.
RESUMABLE = {
    "train.max_steps": "how far the run trains",
    "train.epochs": "how far the run trains",
    "train.val_period": "how often it validates",
    "train.val_samples": "how many val samples a validation scores",
    "train.stop_after": "where this attempt stops (at a checkpoint)",
    "checkpoint.dir": "where its checkpoints are: a folder of this run's own (moved, or copied for a copied run "
    "directory); one without any trains from step 0",
    "checkpoint.save_period": "how often it checkpoints",
    "checkpoint.keep": "how many checkpoints it keeps",
    "checkpoint.requeue": "its requeue budget",
    "checkpoint.async_save": "whether a checkpoint is written behind the next steps",
    "cluster": "where and with which resources it runs",
    "logger": "where its metrics are mirrored",
    "data.on_bad_sample": "a recovery step: with drop, the sample that stopped the run (and any other the run "
    "cannot train on) is skipped and counted in dropped_samples; the samples before it were all trained",
    "data.error_tolerance": "a recovery step: how many bad samples a loader shard skips before the run fails",
    "data.check_at_submit": "whether `vlmrun submit` checks the data set (a resume never does)",
    "generation.refit_bucket_mb": "the memory a refit takes beyond the engine's weights; no number changes",
    "generation.release_weights": "whether the engine's weights are freed between uses; no number changes",
    **dict.fromkeys(RELAYOUTABLE, RELAYOUT_TERMS),
}
#: Fields a resume refuses for a reason worth more than "it would change the sample stream".
REFUSED_BECAUSE = {
    "data.num_workers": "each loader worker reads its own slices of the split with its own seed and the shard "
    "takes their groups in turn, so another worker count is another sample order, and Energon's saved "
    "position (one entry per worker) restores only at the count it was saved with",
}


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
    set_dotted(raw, "train.stop_after", None)  # for one attempt only: this one stops where its --set says
    for item in overrides:
        key, value = parse_override(item)
        check_resumable_field(key, value, restart_data_order)
        if key == "checkpoint.dir" and isinstance(value, str):  # as submit has it: absolute
            value = str(Path(value).expanduser().resolve())
        set_dotted(raw, key, value)
    set_dotted(raw, "checkpoint.restart_data_order", restart_data_order)  # for this attempt only
    recipe = validate(raw)
    check_recipe(recipe)
    changes = changed_settings(_stored_recipe(rd), recipe, [parse_override(item)[0] for item in overrides])
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
        job_record.set_resume_changes(rd, changes, cluster=executor.cluster, name=recipe.name)
        for change in changes if echo else ():
            echo(f"this resume changes {change}: {_what_it_does(change.split(':', 1)[0])}")
        result = executor.resume(rd, recipe, wait=wait, lock=lock, echo=echo)
    except BaseException:
        lock.release()
        raise
    result.changes = changes
    return result


def check_resumable_field(key: str, value, restart_data_order: bool) -> None:
    """Refuse (InputError, exit 2) a `--set key=value` that a resume may not make (RESUMABLE; with
    `restart_data_order`, RESHARDABLE too), saying why and what it may change."""
    if key in RESHARDABLE and not restart_data_order:
        raise InputError(
            key,
            value,
            message=f"{key}: {value}: a resume at another layout would {RESHARD_TERMS}; "
            "pass --restart-data-order to accept that",
        )
    resumable = (*RESUMABLE, *(RESHARDABLE if restart_data_order else ()))
    if not any(key == p or key.startswith(p + ".") for p in resumable):
        why = REFUSED_BECAUSE.get(
            key, "changing it would change the sample stream or placement the checkpoint belongs to"
        )
        raise InputError(key, value, f"{why}; a resume may change {', '.join(resumable)}")


def changed_settings(before, after, keys: list[str]) -> list[str]:
    """`field: old -> new` for each of `keys` (a resume's --set fields) whose value differs between the
    recipes `before` (None: recipe.yaml was no valid recipe, its values unknown) and `after`, in order."""
    changes = []
    for key in dict.fromkeys(keys):
        old, new = _dotted(before, key) if before is not None else "?", _dotted(after, key)
        if old != new:
            changes.append(f"{key}: {old if before is None else _shown(old)} -> {_shown(new)}")
    return changes


def _stored_recipe(rd):
    """The run's recipe as recipe.yaml holds it, or None when it is no valid recipe (a --set may mend it)."""
    try:
        return rd.load_recipe()
    except InputError:
        return None


def _what_it_does(key: str) -> str:
    """What a resume's change of `key` does, in RESUMABLE's words (RESHARD_TERMS' for a new layout)."""
    does = {**RESUMABLE, **dict.fromkeys(RESHARDABLE, RESHARD_TERMS)}
    return next((d for p, d in does.items() if key == p or key.startswith(p + ".")), "")


def _dotted(recipe, key: str):
    value = recipe
    for part in key.split("."):
        value = getattr(value, part, None)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        ignore = RESHARDABLE + RELAYOUTABLE if recipe.checkpoint.restart_data_order else RELAYOUTABLE
        current = run_identity(recipe, model_contents=model_contents(recipe.model))
        check_same_identity(manifest.identity, current, where=f"the checkpoint of step {step}", ignore=ignore)


def _nothing_left(rd, recipe) -> int | None:
    """The run's planned step count when its newest valid checkpoint already reached it, else None."""
    from vlmrun.algorithms.common.steps import plan_steps, run_loader_format
    from vlmrun.data.splits import split_size

    found, _ = run_checkpoints(rd, recipe, assign=False).latest()
    loader_format = run_loader_format(found, restart=recipe.checkpoint.restart_data_order)
    try:
        planned = plan_steps(recipe, split_size(recipe.data.path, recipe.data.split), loader_format=loader_format)
        planned = planned.max_steps
    except InputError:  # the data set is gone: the job would say so; count on train.max_steps
        planned = recipe.train.max_steps
    return planned if found is not None and found.step >= planned else None
