"""A copied run directory, and which checkpoints it may write, count and delete.

1. A run directory records the directory it was made for (run.json's run_dir; one from before that, the
   run_dir of its checkpoint folder's claim). Found elsewhere while a run directory of the same run id
   still lives there, it is a copy (`cp -a`); found elsewhere with the other gone (or holding another
   run), it was moved (`mv`), and its job records the new place when it starts.
2. A copy goes on as a fork: at its job's start it takes a run id of its own (run.json's forked_from
   names the run it came from; job.json's `forks` records when), and the checkpoints it brought along
   are its own from then on: those in a folder of its own, inside the copy (the default
   checkpoint.dir) or a copy of the original's folder (a claim written for another folder). What it
   writes names the fork; the original's folder is never touched.
3. A copy whose checkpoint.dir is the original's own folder is refused (exit 2) at `vlmrun resume` and
   at its job's start, before it reads anything: it would resume from, write into and delete the
   original's checkpoints. The message says how to go on: give the copy a folder of its own.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from vlmrun.checkpoint.owner import CheckpointOwner, read_claim, take_over_claim
from vlmrun.errors import InputError
from vlmrun.run.directory import RunDirectory


class CopySharesCheckpoints(InputError):
    """A copied run directory whose checkpoint.dir is the original's folder (exit 2)."""

    def __init__(self, rd: RunDirectory, original: RunDirectory, folder: Path):
        mine = f"{folder.parent}/{folder.name}-{rd.path.name}"
        super().__init__(
            "checkpoint.dir",
            str(folder),
            message=f"checkpoint.dir: {folder} holds the checkpoints of {original.path}, of which {rd.path} is "
            "a copy; the copy would resume from, write into and delete that run's checkpoints. Give the copy a "
            f"folder of its own: `cp -a {folder} {mine}` and `vlmrun resume {rd.path} --set checkpoint.dir={mine}` "
            "(an empty folder trains from step 0)",
        )


@dataclass(frozen=True)
class Fork:
    """A copy that went on as a run of its own: its new run id, and the run it was copied from."""

    run_id: str
    from_run_id: str
    from_run_dir: str


def original_of(rd: RunDirectory, recipe) -> RunDirectory | None:
    """The run directory that `rd` is a copy of (module doc), or None. Raises CopySharesCheckpoints when
    its checkpoint folder is that run's own (module doc)."""
    folder = rd.checkpoints(recipe)
    home = rd.home()
    if home is None:  # run.json from before vlmrun recorded its directory: the claim's is the run's
        claim = _claim_or_none(folder)
        mine = rd.run_id(assign=False).value
        home = Path(claim.run_dir) if claim is not None and claim.run_id == mine and claim.run_dir else None
    original = rd.original(home)
    if original is not None and _originals_folder(folder, original, rd):
        raise CopySharesCheckpoints(rd, original, folder)
    return original


def settle_copy(rd: RunDirectory, recipe) -> Fork | None:
    """At the job's start, holding the run lock: a copy forks (module doc), a moved run directory
    records its new place; the Fork, or None. Raises CopySharesCheckpoints (module doc)."""
    original = original_of(rd, recipe)
    if original is None:
        rd.settle_home()
        return None
    parent = rd.run_id(assign=False)
    forked = rd.fork(original)
    take_over_claim(rd.checkpoints(recipe), CheckpointOwner.of(rd, assign=False), parent.value)
    return Fork(forked.value, parent.value, str(original.path))


def _originals_folder(folder: Path, original: RunDirectory, rd: RunDirectory) -> bool:
    """Whether `folder` is the checkpoint folder of `original` itself, not a copy of it: the folder its
    recipe names, or the folder its claim was written for."""
    named = _recipe_folder(original)
    if _same_place(folder, named):
        return True
    claim = _claim_or_none(folder)
    if claim is None or claim.run_id != rd.run_id(assign=False).value:
        return False  # nobody's yet, or another run's (the claim check refuses that one)
    if claim.folder is not None:
        return _same_place(folder, Path(claim.folder))
    # a claim from before vlmrun recorded the folder, and no recipe to ask: only one inside the copy is a copy
    return named is None and not folder.is_relative_to(rd.path)


def _recipe_folder(rd: RunDirectory) -> Path | None:
    """The checkpoint folder `rd`'s recipe.yaml names (None when it cannot be read)."""
    from vlmrun.config.load import read_yaml

    try:
        raw = read_yaml(rd.recipe_file, field="RUN_DIR")
    except InputError:
        return None
    named = (raw.get("checkpoint") or {}).get("dir") if isinstance(raw.get("checkpoint"), dict | None) else None
    return Path(named) if isinstance(named, str) and named else rd.path / "checkpoints"


def _same_place(a: Path, b: Path | None) -> bool:
    if b is None:
        return False
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


def _claim_or_none(folder: Path):
    try:
        return read_claim(folder)
    except InputError:  # an unreadable claim: the store's own check names it
        return None
