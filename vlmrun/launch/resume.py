"""`vlmrun resume`: continue an ended run from its newest complete checkpoint, as a new attempt.

Overrides that would change the sample stream or the placement (what the loader fingerprint and the
checkpoint's placement hash would refuse) are refused here, before anything starts, naming the field.
"""

from __future__ import annotations

from collections.abc import Callable

import yaml

from vlmrun.errors import InputError
from vlmrun.launch.local import start_local
from vlmrun.launch.preflight import preflight_run
from vlmrun.launch.slurm.queries import is_live
from vlmrun.launch.targets import find_run
from vlmrun.run import job as job_record
from vlmrun.run.directory import dump_recipe, write_atomic

# Fields a resume may change: none of them changes which samples a step sees or where ranks sit.
RESUMABLE = (
    "train.max_steps",
    "train.epochs",
    "train.val_period",
    "train.val_samples",
    "train.loop",
    "checkpoint.save_period",
    "checkpoint.keep",
    "checkpoint.requeue",
    "cluster",
    "logger",
)


def resume_run(target: str, overrides: list[str], *, wait: bool, echo: Callable[[str], None] | None = None):
    from vlmrun.config.load import parse_override, set_dotted, validate

    rd, last_job = find_run(target)
    job = job_record.read_job(rd)
    slurm = job is not None and job.cluster == "slurm"
    if slurm and last_job and is_live(str(last_job)):
        raise InputError(
            "JOBID|RUN_DIR",
            target,
            message=f"job {last_job} of {rd.path} is still in the queue; "
            f"wait for it or `vlmrun cancel {last_job}` before resuming",
        )
    if job is not None and not slurm and (pid := job_record.running_pid(job)) is not None:
        raise InputError("RUN_DIR", target, message=f"{target} is still running (pid {pid}); stop it before resuming")
    raw = yaml.safe_load(rd.recipe_file.read_text())
    for item in overrides:
        key, value = parse_override(item)
        if not any(key == p or key.startswith(p + ".") for p in RESUMABLE):
            raise InputError(
                key,
                value,
                "changing it would change the sample stream or placement the checkpoint "
                f"belongs to; a resume may change {', '.join(RESUMABLE)}",
            )
        set_dotted(raw, key, value)
    recipe = validate(raw)
    preflight_run(recipe, runs_here=not slurm)
    if overrides:
        write_atomic(rd.recipe_file, dump_recipe(recipe))
    if slurm:
        from vlmrun.launch.slurm.submit import resume_slurm

        return resume_slurm(rd, recipe, wait=wait, echo=echo)
    return start_local(rd, recipe, wait=wait, echo=echo)
