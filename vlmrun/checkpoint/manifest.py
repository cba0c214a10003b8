"""A checkpoint's manifest: what the checkpoint is, the run that wrote it, and every file with its digest.

`manifest.json` is the last file of a checkpoint written (the seal, files.py): a folder without a readable
one is torn. `Manifest` is its typed form; `read_manifest` parses it (format 1's `meta.json` too) and
raises CorruptCheckpoint for anything that is not a manifest. Which formats can be resumed is decided by
`verify` (read.py), not here: a manifest of a newer format still parses, so the store can tell whose it is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlmrun.checkpoint import files
from vlmrun.checkpoint.legacy import UNRECORDED_LOADER_FORMAT, V1_MANIFEST

FORMAT = 4
MANIFEST = "manifest.json"


class CorruptCheckpoint(Exception):
    """A checkpoint folder that must not be resumed from (torn, damaged, incomplete, unknown format)."""


@dataclass(frozen=True)
class RunAtSave:
    """What the run was when it saved a checkpoint: where its ranks sat, what it ran, its counters.

    `identity` is config/identity.py's run identity ({dotted field: value}); a resume compares it with
    the recipe about to run. Checkpoints of format 1 record no identity and no algorithm.
    """

    placement_hash: str
    layout: str
    loop: str | None = None
    algorithm: str | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    attempt: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    loader_format: int | None = None  # the loaders' stream (vlmrun.data.fingerprint); None: legacy.py's


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest. `run_id` and `run_dir` name the run that wrote it (none before run ids)."""

    format: int
    step: int
    files: dict[str, files.Digest]
    run: RunAtSave | None = None
    saved_at: float | None = None
    run_id: str | None = None
    run_dir: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """The manifest in `data` (a parsed manifest.json); CorruptCheckpoint naming what is malformed."""
        if not isinstance(data, dict):
            raise CorruptCheckpoint("the manifest is not a JSON object")
        for key, kind, what in (
            ("format", int, "an integer"),
            ("step", int, "an integer"),
            ("files", dict, "an object"),
        ):
            if type(data.get(key)) is not kind:
                raise CorruptCheckpoint(f"the manifest's {key} is {data.get(key)!r}, not {what}")
        entries = {name: _digest(name, entry) for name, entry in data["files"].items()}
        run = None
        if isinstance(data.get("placement_hash"), str) and isinstance(data.get("layout"), str):
            known = RunAtSave.__dataclass_fields__
            run = RunAtSave(**{k: data[k] for k in known if data.get(k) is not None})
        stamp = {k: data[k] for k in ("saved_at", "run_id", "run_dir") if data.get(k) is not None}
        return cls(data["format"], data["step"], entries, run, **stamp)

    def to_json(self) -> dict:
        out = {"format": self.format, "step": self.step, "files": {n: e.to_json() for n, e in self.files.items()}}
        out |= {k: getattr(self, k) for k in ("saved_at", "run_id", "run_dir") if getattr(self, k) is not None}
        if self.run is not None:
            out |= {k: v for k, v in asdict(self.run).items() if v is not None}
        return out

    @property
    def identity(self) -> dict[str, Any]:
        """The run identity the checkpoint recorded ({} for a format that recorded none)."""
        return self.run.identity if self.run is not None else {}

    @property
    def loader_format(self) -> int:
        """The loader format the run's loaders read when it saved (one that recorded none: legacy.py's)."""
        recorded = self.run.loader_format if self.run is not None else None
        return recorded if recorded is not None else UNRECORDED_LOADER_FORMAT


def _digest(name: str, entry: Any) -> files.Digest:
    digest = files.Digest.from_json(entry)
    if digest is None:
        raise CorruptCheckpoint(f"the manifest's entry of {name} is not a size and a checksum vlmrun knows: {entry!r}")
    return digest


def manifest_file(path: Path) -> Path:
    """The manifest of the checkpoint folder `path` (format 1's meta.json when only that is there)."""
    if not (path / MANIFEST).exists() and (path / V1_MANIFEST).exists():
        return path / V1_MANIFEST
    return path / MANIFEST


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint folder `path`, unverified; CorruptCheckpoint when it is missing,
    unreadable or malformed."""
    for name in (MANIFEST, V1_MANIFEST):
        try:
            text = (path / name).read_text()
        except FileNotFoundError:
            continue
        except UnicodeDecodeError as e:
            raise CorruptCheckpoint(f"{name} unreadable: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CorruptCheckpoint(f"{name} unreadable: {e}") from None
        return Manifest.from_json(data)
    raise CorruptCheckpoint(f"no {MANIFEST} (torn write)")


def seal(folder: Path, manifest: Manifest) -> None:
    """Write `manifest` into `folder` and fsync every file and folder in it (files.seal)."""
    files.seal(folder, manifest.to_json(), MANIFEST)
