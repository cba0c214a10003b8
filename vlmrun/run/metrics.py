"""metrics.jsonl: one JSON object per optimizer step; our source of truth (wandb is a mirror).

A resumed attempt appends rows; readers take, for each step, the row of the latest attempt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vlmrun.run.directory import RunDirectory


class MetricsLog:
    """Appends rows with one write(2) each; on open, drops a torn last line left by a killed writer."""

    def __init__(self, path: Path):
        self.path = Path(path)
        _drop_torn_tail(self.path)

    def append(self, row: dict) -> None:
        data = (json.dumps(row, sort_keys=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _drop_torn_tail(path: Path) -> None:
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def read_rows(path: Path) -> list[dict]:
    """All parseable rows; a torn last line (the writer was killed mid-write) is ignored."""
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def history(path: Path) -> dict[int, dict]:
    """step -> the row of the latest attempt that wrote that step."""
    out: dict[int, dict] = {}
    for row in read_rows(path):
        prev = out.get(row["step"])
        if prev is None or row.get("attempt", 0) >= prev.get("attempt", 0):
            out[row["step"]] = row
    return out


def last_metrics(rd: RunDirectory, tail_bytes: int = 65536) -> dict:
    """{last_step, loss} of the newest metrics.jsonl row (reads only the file's tail)."""
    path = rd.metrics_file()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {"last_step": None, "loss": None}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        return {"last_step": row.get("step"), "loss": row.get("loss")}
    return {"last_step": None, "loss": None}


class RowFollower:
    """Reads rows appended to metrics.jsonl since the last call (for the console progress line)."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), Path(path).stat().st_size if Path(path).exists() else 0

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
