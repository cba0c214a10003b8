"""`vlmrun compare v1 v2 --recipe R`: run one recipe through both SFT loops, same seed, then compare.

The two runs advance in alternating parts, so their throughputs are measured close together in time
(a shared machine's load comes and goes between two runs taken one after the other):

1. With `rounds` R the parts are A B A ... (R + 1 parts, A = the first loop): each loop's steps are cut
   into its share of the parts, and a part ends exactly at its planned step through the product's own
   stop point (`train.stop_after`: the run checkpoints there and stops, resumable); the next part of
   that loop is `vlmrun resume`. The LR schedule and every other recipe field stay those of one
   uninterrupted run, and a resume continues exactly, so the losses compared are those of
   uninterrupted runs (the step history does not show where a run was cut).
2. Every two neighbouring parts give one ratio of throughputs (observe/compare.py): R ratios, reported
   as their median with the spread. R = 1 runs one loop after the other (one ratio).
3. A loop with fewer steps than parts (`--steps 1 --rounds 4`) has fewer parts: a part of no steps is
   not run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from vlmrun.errors import CheckFailed, InputError
from vlmrun.run.directory import RunDirectory

LOOPS = ("v1", "v2")


def compare_targets(
    a: str,
    b: str,
    *,
    recipe: Path | None,
    steps: int | None,
    overrides: list[str],
    out: Path | None,
    rtol: float,
    rounds: int = 2,
    echo: Callable[[str], None] | None = None,
) -> dict:
    """Two loop names (runs them first, in alternating parts: see the module docstring) or two run directories."""
    from vlmrun.observe.compare import compare_sides, load_side

    out = out or Path.cwd() / "runs" / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if a in LOOPS and b in LOOPS:
        if recipe is None:
            raise InputError("--recipe", None, "comparing loops needs a recipe: vlmrun compare v1 v2 --recipe R")
        if a == b:
            raise InputError("B", b, f"another loop than A ({a}): vlmrun compare v1 v2 --recipe R")
        dirs = {loop: out / loop for loop in (a, b)}
        for run_dir in dirs.values():
            if RunDirectory(run_dir).exists():
                raise InputError("--out", str(out), f"{run_dir} already holds a run; choose another --out")
        _run_alternating(recipe, dirs, steps, overrides, rounds, echo)
        sides = [load_side(loop, d, _metrics_name(d)) for loop, d in dirs.items()]
    else:
        if recipe is not None or steps is not None:
            raise InputError("--recipe", str(recipe), "--recipe and --steps apply only to `compare v1 v2`")
        sides = []
        for label, target in (("A", a), ("B", b)):
            rd = RunDirectory(target)
            if not rd.exists():
                raise InputError(label, target, "must be v1/v2 (with --recipe) or a vlmrun run directory")
            sides.append(
                load_side(rd.path.name if rd.path.name != "" else label, rd.path, rd.load_recipe().logger.metrics_file)
            )
        if sides[0].label == sides[1].label:
            sides[0].label, sides[1].label = f"A-{sides[0].label}", f"B-{sides[1].label}"
    return compare_sides(sides[0], sides[1], rtol=rtol, out_dir=out)


def part_ends(steps: int, parts: int) -> list[int]:
    """The step each of a loop's `parts` parts should end after (the last one: `steps`)."""
    return [max(1, round(steps * (k + 1) / parts)) for k in range(parts)]


def _run_alternating(recipe: Path, dirs: dict[str, Path], steps: int | None, overrides: list[str], rounds, echo):
    """Run the loops of `dirs` in R + 1 alternating parts (module docstring), each to its planned end."""
    from vlmrun.config.load import load_recipe

    sets = {loop: _loop_sets(loop, steps, overrides) for loop in dirs}
    first, second = dirs
    planned = load_recipe(recipe, sets[first]).train.max_steps  # InputError for a bad recipe, before any run
    order = [first if k % 2 == 0 else second for k in range(rounds + 1)]
    ends = {loop: part_ends(planned, order.count(loop)) for loop in dirs}
    done = {loop: 0 for loop in dirs}
    for loop in order:
        part, at = done[loop], _last_step(dirs[loop])
        done[loop] += 1
        if _completed(dirs[loop]) or ends[loop][part] <= at:
            continue  # the run finished, or this part has no steps (fewer steps than parts)
        last = part == len(ends[loop]) - 1 or ends[loop][part] >= planned
        stop_after = None if last else ends[loop][part]
        if echo:
            echo(
                f"running {loop} into {dirs[loop]} from step {at + 1} "
                + (f"to {stop_after}" if stop_after else "to the end")
            )
        _run_part(
            recipe, sets[loop], dirs[loop], started=RunDirectory(dirs[loop]).exists(), stop_after=stop_after, echo=echo
        )
    for loop, run_dir in dirs.items():
        if not _completed(run_dir):
            raise CheckFailed(f"the {loop} run did not complete; see {run_dir}/logs")


def _loop_sets(loop: str, steps: int | None, overrides: list[str]) -> list[str]:
    # each loop's checkpoints in its own run dir: a checkpoint folder serves one run
    sets = [*overrides, f"train.loop={loop}", "train.val_samples=0", "checkpoint.save_period=0", "checkpoint.dir=null"]
    return sets + ([f"train.max_steps={steps}"] if steps is not None else [])


def _run_part(recipe: Path, sets: list[str], run_dir: Path, *, started: bool, stop_after: int | None, echo) -> None:
    """Start (submit) or continue (resume) the run in `run_dir` and wait for it: with `stop_after`, it
    stops checkpointed after that step (`train.stop_after`), else it runs to its end. Raises CheckFailed
    when it fails or ends otherwise."""
    from vlmrun.launch.resume import resume_run
    from vlmrun.launch.submit import submit_run
    from vlmrun.run.state import EXIT_COMPLETED, EXIT_STOPPED

    until = [f"train.stop_after={stop_after}"] if stop_after is not None else []
    shown = echo if stop_after is None else None  # progress only from the last part
    if started:
        result = resume_run(str(run_dir), until, wait=True, echo=shown)
    else:
        result = submit_run(recipe, sets + until, cluster="local", run_dir=run_dir, wait=True, echo=shown)
    expected = EXIT_COMPLETED if stop_after is None else EXIT_STOPPED
    if result.exit_code != expected:
        raise CheckFailed(f"the run in {run_dir} ended {result.state} (exit {result.exit_code}); see {run_dir}/logs")


def _completed(run_dir: Path) -> bool:
    from vlmrun.run.job import read_job
    from vlmrun.run.state import State

    job = read_job(RunDirectory(run_dir)) if RunDirectory(run_dir).exists() else None
    return job is not None and job.state is State.COMPLETED


def _metrics_name(run_dir: Path) -> str:
    """The run's metrics file (`logger.metrics_file`), relative to its run directory."""
    rd = RunDirectory(run_dir)
    return rd.load_recipe().logger.metrics_file if rd.exists() else "metrics.jsonl"


def _last_step(run_dir: Path, metrics: str | None = None) -> int:
    """The newest step in the run's metrics log (0 before the first); a line being written is skipped."""
    last = 0
    try:
        lines = (run_dir / (metrics or _metrics_name(run_dir))).read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in lines:
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last
