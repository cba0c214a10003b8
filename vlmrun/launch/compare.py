"""`vlmrun compare v1 v2 --recipe R`: run one recipe through both SFT loops, same seed, then compare."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from vlmrun.errors import InputError
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
    echo: Callable[[str], None] | None = None,
) -> dict:
    """Two loop names (runs them first) or two run directories."""
    from vlmrun.observe.compare import compare_sides, load_side

    out = out or Path.cwd() / "runs" / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if a in LOOPS and b in LOOPS:
        if recipe is None:
            raise InputError("--recipe", None, "comparing loops needs a recipe: vlmrun compare v1 v2 --recipe R")
        dirs = {loop: out / loop for loop in (a, b)}
        for run_dir in dirs.values():
            if RunDirectory(run_dir).exists():
                raise InputError("--out", str(out), f"{run_dir} already holds a run; choose another --out")
        for loop, run_dir in dirs.items():
            _run_loop(recipe, loop, run_dir, steps, overrides, echo)
        sides = [load_side(loop, d) for loop, d in dirs.items()]
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


def _run_loop(recipe: Path, loop: str, run_dir: Path, steps: int | None, overrides: list[str], echo) -> None:
    from vlmrun.errors import CheckFailed
    from vlmrun.launch.submit import submit_run

    # each loop's checkpoints in its own run dir: a checkpoint folder serves one run
    sets = [*overrides, f"train.loop={loop}", "train.val_samples=0", "checkpoint.save_period=0", "checkpoint.dir=null"]
    if steps is not None:
        sets.append(f"train.max_steps={steps}")
    if echo:
        echo(f"running {loop} into {run_dir}")
    result = submit_run(recipe, sets, cluster="local", run_dir=run_dir, wait=True, echo=echo)
    if result.exit_code != 0:
        raise CheckFailed(f"the {loop} run failed ({result.state}); see {run_dir}/logs")
