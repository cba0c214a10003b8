"""The run directory: the contract between submit, the job, resume, status and compare.

<run dir>/recipe.yaml     fully resolved recipe; the job reads only this
          run.json        the run's id, given once when the directory is created (RunId)
          job.json        lineage (job ids, attempts, states); read and written by run/job.py
          metrics.jsonl   one row per optimizer step; a resumed attempt appends
          checkpoints/    complete checkpoints only (step_<N>)
          logs/           one log per attempt
          submitit/       on SLURM: sbatch script, pickles, one log per task
          cache/          tiny models and other things the run builds for itself
          wandb/          offline wandb run
          ray/            the Ray head's address files
          lock, lock.json the live attempt's lock and its holder (run/lock.py)
          REQUEUE_REQUESTED, CANCEL_REQUESTED   requests to the running attempt (run/requests.py)

RUN_NAMES lists every one of those names; a file the recipe names (logger.metrics_file) must not be
one of them, and `check_recipe` says so.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from vlmrun.errors import InputError

RECIPE_FILE = "recipe.yaml"
RUN_FILE = "run.json"
JOB_FILE = "job.json"
LOCK_FILE = "lock"  # run/lock.py: the flock of the live attempt
LOCK_HOLDER_FILE = "lock.json"  # run/lock.py: who holds it
REQUEUE_REQUEST = "REQUEUE_REQUESTED"
CANCEL_REQUEST = "CANCEL_REQUESTED"
# The names the run directory itself uses at its top level: the one list (metrics_file may be none of them).
RUN_NAMES = frozenset(
    {
        RECIPE_FILE,
        RUN_FILE,
        JOB_FILE,
        LOCK_FILE,
        LOCK_HOLDER_FILE,
        REQUEUE_REQUEST,
        CANCEL_REQUEST,
        "checkpoints",
        "logs",
        "submitit",
        "cache",
        "wandb",
        "ray",
    }
)


def default_run_dir(name: str, root: Path | None = None) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (root or Path.cwd() / "runs") / f"{name}-{stamp}"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    tmp = _written_beside(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_once(path: Path, text: str) -> bool:
    """Write `text` to `path` unless something is there already; True when this call wrote it.

    Atomic and exclusive (a temp file, then link(2), which never replaces): of two writers at once
    exactly one wins, and a reader sees the whole file or none.
    """
    tmp = _written_beside(path, text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        Path(tmp).unlink(missing_ok=True)


def _written_beside(path: Path, text: str) -> str:
    """A temp file in `path`'s folder (made when missing) holding `text`, on disk; the caller publishes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


@dataclass(frozen=True)
class RunId:
    """Who a run is, wherever its directory lies: given once, when the run directory is created, and
    kept through resumes and requeues (run.json). Every checkpoint names the run id that wrote it.

    `adopted`: the run directory was made before vlmrun gave runs an id and got one later, so the
    checkpoints that name no run are its own.
    """

    value: str
    adopted: bool = False


class RunDirectory:
    """Paths and files of one run; cheap to construct, touches the disk only when asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        self._new_id: str | None = None  # the id `create` writes: drawn when first asked for

    recipe_file = property(lambda self: self.path / RECIPE_FILE)
    run_file = property(lambda self: self.path / RUN_FILE)
    job_file = property(lambda self: self.path / JOB_FILE)
    logs = property(lambda self: self.path / "logs")
    cache = property(lambda self: self.path / "cache")

    def metrics_file(self, recipe=None) -> Path:
        return self.path / (recipe.logger.metrics_file if recipe is not None else "metrics.jsonl")

    def checkpoints(self, recipe) -> Path:
        return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else self.path / "checkpoints"

    def exists(self) -> bool:
        return self.recipe_file.is_file()

    def create(self, recipe) -> None:
        """Make a new run directory holding the resolved recipe; refuses one that holds a run, or a recipe
        that does not fit a run directory (`check_recipe`), before making anything."""
        if self.exists():
            raise InputError(
                "--run-dir",
                str(self.path),
                f"already holds a run; continue it with `vlmrun resume {self.path}` or choose another --run-dir",
            )
        text = dump_recipe(recipe)
        self.path.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        # the id before the recipe: a folder with recipe.yaml but no run.json is one from before run ids
        write_atomic(self.run_file, _run_file_text(RunId(self._draw_id())))
        write_atomic(self.recipe_file, text)

    def run_id(self, *, assign: bool = True) -> RunId:
        """The run's id (run.json). For a run directory not created yet: the id `create` will write.

        For one made before run ids: a new id, `adopted`; with `assign` it is written to run.json (the
        first writer wins, so concurrent callers agree and every later attempt keeps it); without
        (readers), it is not kept. Raises InputError naming run.json when the file is not a run id.
        """
        found = self._read_run_id()
        if found is not None:
            return found
        if not self.exists():
            return RunId(self._draw_id())
        if not assign:
            return RunId(uuid.uuid4().hex[:16], adopted=True)
        write_once(self.run_file, _run_file_text(RunId(uuid.uuid4().hex[:16], adopted=True)))
        return self._read_run_id()

    def _draw_id(self) -> str:
        self._new_id = self._new_id or uuid.uuid4().hex[:16]
        return self._new_id

    def _read_run_id(self) -> RunId | None:
        try:
            data = json.loads(self.run_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise InputError("RUN_DIR", str(self.path), message=f"{self.run_file} is unreadable: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
            raise InputError("RUN_DIR", str(self.path), message=f"{self.run_file} holds no run_id")
        return RunId(data["run_id"], adopted=bool(data.get("adopted", False)))

    def load_recipe(self):
        """The run's validated recipe. Raises InputError naming recipe.yaml when it is missing, is not
        YAML (or unbounded YAML), or is not a recipe this version can run."""
        from vlmrun.config.load import validate

        raw = self.recipe_data()
        try:
            recipe = validate(raw)
            check_recipe(recipe)
        except InputError as e:
            raise InputError(e.field, e.value, e.allowed, message=f"{self.recipe_file}: {e}") from None
        return recipe

    def recipe_data(self) -> dict:
        """recipe.yaml as YAML data, not validated yet (resume applies its --set to it first).

        Raises InputError naming the file when it is missing, not UTF-8, not YAML, unbounded YAML
        (config/load.py's limits) or not a mapping.
        """
        from vlmrun.config.load import read_yaml

        if not self.exists():
            raise InputError(
                "RUN_DIR", str(self.path), message=f"{self.path} is not a vlmrun run directory (no {RECIPE_FILE})"
            )
        return read_yaml(self.recipe_file, field="RUN_DIR")

    def task_log(self, job_id: str, task: int = 0) -> Path:
        """submitit's log of one SLURM task of `job_id`, appended across the job's restarts."""
        return self.path / "submitit" / f"{job_id}_{task}_log.out"

    def attempt_log(self, attempt: int) -> Path:
        return self.logs / f"attempt-{attempt}.log"


def _run_file_text(run_id: RunId) -> str:
    created = datetime.now().astimezone().isoformat(timespec="seconds")
    return json.dumps({"run_id": run_id.value, "created": created, "adopted": run_id.adopted}, indent=1) + "\n"


def check_recipe(recipe) -> None:
    """Refuse (InputError on logger.metrics_file) a recipe whose metrics file would be a file or folder
    that the run directory uses itself (RUN_NAMES, compared without case)."""
    name = recipe.logger.metrics_file
    if name.casefold() in {n.casefold() for n in RUN_NAMES}:
        raise InputError(
            "logger.metrics_file",
            name,
            f"the run directory uses that name itself ({', '.join(sorted(RUN_NAMES))}); choose another, "
            "e.g. metrics.jsonl",
        )


def dump_recipe(recipe) -> str:
    """The text of recipe.yaml for `recipe`; refuses one that does not fit a run directory (`check_recipe`)."""
    check_recipe(recipe)
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
