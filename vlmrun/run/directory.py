"""The run directory: the contract between submit, the job, resume, status and compare.

<run dir>/recipe.yaml     fully resolved recipe; the job reads only this
          job.json        lineage (job ids, attempts, states); read and written by run/job.py
          metrics.jsonl   one row per optimizer step; a resumed attempt appends
          checkpoints/    complete checkpoints only (step_<N>)
          logs/           one log per attempt
          cache/          tiny models and other things the run builds for itself
          wandb/          offline wandb run
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime
from pathlib import Path

import yaml

from vlmrun.errors import InputError


def default_run_dir(name: str, root: Path | None = None) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (root or Path.cwd() / "runs") / f"{name}-{stamp}"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunDirectory:
    """Paths and files of one run; cheap to construct, touches the disk only when asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()

    recipe_file = property(lambda self: self.path / "recipe.yaml")
    job_file = property(lambda self: self.path / "job.json")
    logs = property(lambda self: self.path / "logs")
    cache = property(lambda self: self.path / "cache")

    def metrics_file(self, recipe=None) -> Path:
        return self.path / (recipe.logger.metrics_file if recipe is not None else "metrics.jsonl")

    def checkpoints(self, recipe) -> Path:
        return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else self.path / "checkpoints"

    def exists(self) -> bool:
        return self.recipe_file.is_file()

    def create(self, recipe) -> None:
        """Make a new run directory holding the resolved recipe; refuses one that holds a run."""
        if self.exists():
            raise InputError(
                "--run-dir",
                str(self.path),
                f"already holds a run; continue it with `vlmrun resume {self.path}` or choose another --run-dir",
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        write_atomic(self.recipe_file, dump_recipe(recipe))

    def load_recipe(self):
        from vlmrun.config.load import validate

        if not self.exists():
            raise InputError(
                "RUN_DIR", str(self.path), message=f"{self.path} is not a vlmrun run directory (no recipe.yaml)"
            )
        return validate(yaml.safe_load(self.recipe_file.read_text()))

    def task_log(self, job_id: str, task: int = 0) -> Path:
        """submitit's log of one SLURM task of `job_id`, appended across the job's restarts."""
        return self.path / "submitit" / f"{job_id}_{task}_log.out"

    def attempt_log(self, attempt: int) -> Path:
        return self.logs / f"attempt-{attempt}.log"


def dump_recipe(recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
