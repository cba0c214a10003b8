"""metrics.jsonl: one JSON object per optimizer step; our source of truth (wandb is a mirror).

A resumed attempt appends rows; readers take, for each step, the row of the latest attempt.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=False) + "\n")
            f.flush()


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
