"""Which run a folder of checkpoints belongs to, and the refusal when it is another run's.

1. Every checkpoint's manifest names the run that wrote it (`run_id`, `run_dir`: the run directory's
   RunId). A folder of checkpoints (`checkpoint.dir`, default `<run dir>/checkpoints`) is claimed by
   one run in `owner.json` (run id, run dir, the folder itself, when), written once and atomically
   (`write_once`): at `vlmrun submit` for an explicit checkpoint.dir, else when the run's job first
   starts. Of two submits at once onto one folder, exactly one claim is written; the other is
   refused. A run that finds its claim naming another run dir or folder (it was moved) brings the
   claim up to date; a fork takes over the claim of the folder it copied (copies.py).
2. A folder is another run's when its claim names another run id or, unclaimed, when it holds a
   sealed checkpoint that is not this run's: one naming another run, one naming none (written before
   runs had ids) or one whose manifest cannot be read. A run directory made before run ids
   (`RunId.adopted`) takes the checkpoints that name no run as its own.
3. Inside its folder a run lists only its own checkpoints (`owns`): those naming it or a run it forked
   from (it brought them along), those naming no run when it adopted them, and damaged ones whose
   manifest cannot be read (in its own folder nobody else writes). So it never loads, counts or
   deletes another run's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from vlmrun.checkpoint.manifest import Manifest
from vlmrun.errors import InputError
from vlmrun.run.directory import RunDirectory, write_atomic, write_once

CLAIM = "owner.json"


@dataclass(frozen=True)
class CheckpointOwner:
    """The run a store works for: its id, its directory (for messages), whether it adopts checkpoints
    that name no run (a run directory from before run ids), and the run ids it forked from."""

    run_id: str
    run_dir: str
    adopts_unnamed: bool = False
    ancestors: tuple[str, ...] = ()

    @classmethod
    def of(cls, rd: RunDirectory, *, assign: bool = True) -> CheckpointOwner:
        """The owner for run directory `rd` (RunDirectory.run_id: `assign` gives an old run dir its id)."""
        run_id = rd.run_id(assign=assign)
        return cls(run_id.value, str(rd.path), run_id.adopted, run_id.ancestors)

    def stamp(self) -> dict[str, str]:
        """What every manifest this run writes records about it."""
        return {"run_id": self.run_id, "run_dir": self.run_dir}

    def owns(self, manifest: Manifest | None) -> bool:
        """Whether a checkpoint in this run's own folder with `manifest` (None: unreadable) is this run's."""
        if manifest is None:
            return True
        named = manifest.run_id
        return named == self.run_id or named in self.ancestors if named is not None else self.adopts_unnamed


class ForeignCheckpoints(InputError):
    """The checkpoint folder belongs to another run: a run never reads, counts or deletes another's (exit 2)."""

    def __init__(self, folder: Path, whose: str):
        super().__init__(
            "checkpoint.dir",
            str(folder),
            message=f"checkpoint.dir: {folder} {whose}; a checkpoint folder serves one run, so this run "
            "would resume from, count and delete that run's checkpoints: choose another checkpoint.dir",
        )


@dataclass(frozen=True)
class Claim:
    """A folder's claim (owner.json): the run it belongs to, the folder it was written for (None in
    claims from before vlmrun recorded it: a copied folder holds the original's), and when."""

    run_id: str
    run_dir: str | None = None
    claimed: str | None = None
    folder: str | None = None


def read_claim(folder: Path) -> Claim | None:
    """The claim of `folder`, None when it has none; InputError on checkpoint.dir when it is unreadable."""
    try:
        claim = json.loads((folder / CLAIM).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InputError(
            "checkpoint.dir", str(folder), message=f"checkpoint.dir: {folder / CLAIM} unreadable: {e}"
        ) from None
    if not isinstance(claim, dict) or not isinstance(claim.get("run_id"), str):
        raise InputError("checkpoint.dir", str(folder), message=f"checkpoint.dir: {folder / CLAIM} names no run_id")
    return Claim(claim["run_id"], claim.get("run_dir"), claim.get("claimed"), claim.get("folder"))


def check_folder(folder: Path, owner: CheckpointOwner, sealed: dict[Path, Manifest | None]) -> None:
    """Raise ForeignCheckpoints when `folder` is another run's: its claim, or (unclaimed) any of its
    `sealed` checkpoints ({folder: manifest, None when unreadable}) that is not `owner`'s."""
    claim = read_claim(folder)
    if claim is not None:
        if claim.run_id != owner.run_id:
            raise ForeignCheckpoints(folder, f"belongs to another run: {_describe(claim.run_id, claim.run_dir)}")
        return
    for path, manifest in sealed.items():
        named = manifest.run_id if manifest is not None else None
        if named == owner.run_id or (manifest is not None and named is None and owner.adopts_unnamed):
            continue
        if named is not None:
            whose = f"holds {path.name} of another run: {_describe(manifest.run_id, manifest.run_dir)}"
        elif manifest is None:
            whose = f"holds {path.name}, whose manifest cannot be read, of a run that is not this one"
        else:
            whose = f"holds {path.name} of another run (written before vlmrun gave runs an id)"
        raise ForeignCheckpoints(folder, whose)


def claim_folder(folder: Path, owner: CheckpointOwner) -> bool:
    """Write `owner`'s claim on `folder` (made with its parents when missing); True when this call wrote
    it. Its own claim naming another run dir or folder (moved since) is brought up to date. Raises
    ForeignCheckpoints when another run claimed it first, also in a race."""
    if write_once(folder / CLAIM, _claim_text(folder, owner)):
        return True
    claim = read_claim(folder)
    if claim is None or claim.run_id != owner.run_id:
        whose = _describe(claim.run_id, claim.run_dir) if claim is not None else _describe("?", None)
        raise ForeignCheckpoints(folder, f"belongs to another run: {whose}")
    if (claim.run_dir, claim.folder) != (owner.run_dir, str(folder)):
        write_atomic(folder / CLAIM, _claim_text(folder, owner))
    return False


def take_over_claim(folder: Path, owner: CheckpointOwner, parent: str) -> None:
    """`owner` (a fork of run `parent`) takes the claim of `folder`, a copy of its parent's folder that
    it brought along (copies.py); a folder unclaimed, or claimed by another run, is left as it is."""
    claim = read_claim(folder)
    if claim is not None and claim.run_id == parent:
        write_atomic(folder / CLAIM, _claim_text(folder, owner))


def _claim_text(folder: Path, owner: CheckpointOwner) -> str:
    when = datetime.now().astimezone().isoformat(timespec="seconds")
    return json.dumps(owner.stamp() | {"folder": str(folder), "claimed": when}, indent=1) + "\n"


def release_claim(folder: Path, owner: CheckpointOwner) -> None:
    """Withdraw `owner`'s claim on `folder` (a submit that failed before its run came to be)."""
    claim = read_claim(folder)
    if claim is not None and claim.run_id == owner.run_id:
        (folder / CLAIM).unlink(missing_ok=True)


def _describe(run_id: str | None, run_dir: str | None) -> str:
    if not run_dir:
        return f"run id {run_id}"
    resume = f" (continue it with `vlmrun resume {run_dir}`)" if RunDirectory(run_dir).exists() else ""
    return f"{run_dir}, run id {run_id}{resume}"
