"""The data check at submit: a prepared data set is checked against the recipe before any work.

`vlmrun submit` (dry runs too) calls `check_data_at_submit` after the recipe, the memory estimate and
the preflight passed, and before a run directory exists, so a data set the run would stop on is
refused in the terminal (exit 2, naming the samples) rather than in the job's log after the queue. A
set the job generates (data.synthetic) is vlmrun's own and is not checked; a model directory that is
not on this machine (a dry run with model.reference_config) leaves the check to `vlmrun data check`
where it is. The loader applies the same rules to every sample it reads, whatever was checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlmrun.errors import InputError


def check_data_at_submit(recipe, *, echo: Callable[[str], None] | None = None):
    """The `DataCheck` of `recipe`'s data set (cached: vlmrun.data.check), or None where none runs.

    Raises InputError on data.path, listing what would stop the run, when the check finds it; its
    warnings go to `echo`.
    """
    from vlmrun.datasets.prepare import generated_by_job

    d = recipe.data
    if not d.check_at_submit or generated_by_job(d):
        return None
    from vlmrun.data.check import cached_check
    from vlmrun.observe.progress import progress_bar

    processor_dir = processor_dir_for(recipe)
    if processor_dir is None:
        return None
    with progress_bar("checking data", enabled=echo is not None) as progress:
        result = cached_check(recipe, processor_dir, progress)
    if not result.ok:
        raise InputError(
            "data.path",
            d.path,
            message=f"data.path: {d.path}: the run would stop on its samples: {'; '.join(result.problems)}. "
            f"`vlmrun data check {d.path} --recipe <recipe>` lists them (data.check_at_submit=false skips this)",
        )
    for warning in result.warnings:
        if echo is not None:
            echo(f"warning: {warning}")
    return result


def processor_dir_for(recipe) -> str | None:
    """The model directory whose processor the job will use; a tiny one is built in the user cache (or
    $VLMRUN_TINY_MODELS). None when model.path has no model here (a dry run with reference_config)."""
    from vlmrun.data.check import cache_dir
    from vlmrun.models.source import ensure_model

    if not recipe.model.tiny:
        path = Path(recipe.model.path)
        return str(path) if (path / "config.json").is_file() else None
    return str(ensure_model(recipe.model, cache_dir(), recipe.train.seed))
