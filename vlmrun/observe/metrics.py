"""metrics.jsonl: one JSON object per optimizer step; our source of truth (wandb is a mirror).

A resumed attempt appends rows; readers take, for each step, the row of the latest attempt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


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
