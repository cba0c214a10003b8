"""The marker file a complete data set ends with: its summary and every file's size, written last.

`vlmrun data clevr` (clevr.json) and `vlmrun data prepare` (prepare.json) each write one into their set
as its last file. A set whose marker is there, of the writer's version, with every listed file at its
size, is complete; anything else (missing, torn, another writer's, a file changed since) reads as None.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_marker(folder: Path, name: str, version: int, summary: dict) -> None:
    """Write `name` into `folder`: `summary` and the size of every other file in it."""
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != name
    }
    data = {"version": version, "summary": summary, "files": files}
    (folder / name).write_text(json.dumps(data, indent=2) + "\n")


def read_marker(folder: Path, name: str, version: int) -> dict | None:
    """The summary of the complete set at `folder`, or None (module doc)."""
    try:
        data = json.loads((Path(folder) / name).read_text())
        if data.get("version") != version:
            return None
        for file, size in data["files"].items():
            if (Path(folder) / file).stat().st_size != size:
                return None
        return data["summary"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, torn or not ours
        return None
