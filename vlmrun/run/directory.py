"""The run directory: the contract between submit, the job, resume, status and compare.

<run dir>/recipe.yaml     fully resolved recipe; the job reads only this
          run.json        the run's id, given once when the directory is created (RunId), the
                          directory it was written for (a copy elsewhere is told from a move by it),
                          and the runs this one forked from
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

import contextlib
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
    checkpoints that name no run are its own. `ancestors`: the run ids this run forked from (a copied
    run directory goes on as a run of its own: checkpoint/copies.py), its parent's first; the
    checkpoints it brought along name them.
    """

    value: str
    adopted: bool = False
    ancestors: tuple[str, ...] = ()


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
        write_atomic(self.run_file, _run_file_text(RunId(self._draw_id()), self.path))
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
        write_once(self.run_file, _run_file_text(RunId(uuid.uuid4().hex[:16], adopted=True), self.path))
        return self._read_run_id()

    def home(self) -> Path | None:
        """The run directory run.json was written for (None: written before vlmrun recorded it)."""
        data = self._run_record()
        home = data.get("run_dir") if data is not None else None
        return Path(home) if isinstance(home, str) else None

    def original(self, home: Path | None = None) -> RunDirectory | None:
        """The run directory this one is a copy of, or None when it is the run's own.

        A copy: run.json was written for another directory (`home`, default `home()`), and a run
        directory of the same run id still lives there. One whose recorded directory is gone, or holds
        another run, was moved here (`settle_home` records that).
        """
        home = home or self.home()
        if home is None or Path(home) == self.path:
            return None
        other = RunDirectory(home)
        with contextlib.suppress(OSError):
            if os.path.samefile(other.path, self.path):
                return None
        try:
            theirs = other._read_run_id() if other.exists() else None
        except InputError:  # a damaged run.json there: not this run
            return None
        mine = self._read_run_id()
        return other if theirs is not None and mine is not None and theirs.value == mine.value else None

    def settle_home(self) -> None:
        """Record this directory as the run's in run.json (a run directory moved here); the caller holds
        the run lock and has checked that this is no copy (`original`)."""
        data = self._run_record()
        if data is not None and data.get("run_dir") != str(self.path):
            write_atomic(self.run_file, json.dumps(data | {"run_dir": str(self.path)}, indent=1) + "\n")

    def fork(self, original: RunDirectory) -> RunId:
        """Make this copy of `original` a run of its own: a new run id in run.json, the run it forked
        from (id, directory, when) first in `forked_from`; returns the new id. The caller holds the run lock."""
        data = self._run_record() or {}
        parent = self.run_id(assign=False)
        step = {"run_id": parent.value, "run_dir": str(original.path), "forked": _now()}
        forked = RunId(uuid.uuid4().hex[:16], parent.adopted, (parent.value, *parent.ancestors))
        lineage = [step, *(data.get("forked_from") or [])]
        write_atomic(self.run_file, _run_file_text(forked, self.path, lineage))
        return forked

    def _draw_id(self) -> str:
        self._new_id = self._new_id or uuid.uuid4().hex[:16]
        return self._new_id

    def _read_run_id(self) -> RunId | None:
        data = self._run_record()
        if data is None:
            return None
        forked = data.get("forked_from") or []
        ancestors = tuple(f["run_id"] for f in forked if isinstance(f, dict) and isinstance(f.get("run_id"), str))
        return RunId(data["run_id"], adopted=bool(data.get("adopted", False)), ancestors=ancestors)

    def _run_record(self) -> dict | None:
        """run.json as written (None when there is none); InputError naming it when it holds no run id."""
        try:
            data = json.loads(self.run_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise InputError("RUN_DIR", str(self.path), message=f"{self.run_file} is unreadable: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
            raise InputError("RUN_DIR", str(self.path), message=f"{self.run_file} holds no run_id")
        if not isinstance(data.get("forked_from", []), list):
            raise InputError("RUN_DIR", str(self.path), message=f"{self.run_file}: forked_from is not a list")
        return data

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


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _run_file_text(run_id: RunId, run_dir: Path, forked_from: list[dict] | None = None) -> str:
    data = {"run_id": run_id.value, "created": _now(), "adopted": run_id.adopted, "run_dir": str(run_dir)}
    return json.dumps(data | ({"forked_from": forked_from} if forked_from else {}), indent=1) + "\n"


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
