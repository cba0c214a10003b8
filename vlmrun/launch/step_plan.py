"""The run's step count as submit sees it: train.max_steps, or fewer where train.epochs caps it."""

from __future__ import annotations

from vlmrun.errors import InputError


def plan_at_submit(recipe):
    """The run's `StepPlan` (algorithms/common/steps.py) over its training split: the one the job will
    read, or the synthetic set's train count where the job generates it. None when the split cannot be
    read here (the job says why). Raises InputError for a split too small for its loader workers."""
    from vlmrun.algorithms.common.steps import plan_steps
    from vlmrun.data.splits import split_size
    from vlmrun.datasets.prepare import generated_by_job

    d = recipe.data
    if generated_by_job(d):
        samples = d.synthetic.train
    else:
        try:
            samples = split_size(d.path, d.split)
        except InputError:
            return None
    return plan_steps(recipe, samples)
