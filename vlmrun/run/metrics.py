"""metrics.jsonl: one JSON object per optimizer step; our source of truth (wandb is a mirror).

A resumed attempt appends rows; readers take, for each step, the row of the latest attempt. The writer
appends each row with one write(2) on an O_APPEND descriptor and, when it opens the file, drops a torn
last line left by a killed writer. The rows' keys: run/rows.py.

Readers (`history`, `last_metrics`) refuse a damaged file with an InputError naming the file, the
line and what is wrong (not UTF-8, not JSON, no whole-number step, a metric that is not a number),
so the CLI prints one line instead of a traceback. One thing is not damage: an unterminated last
line is a row a killed writer left half-written; readers skip it (and tell a caller who asks: `TornRow`)
and the next writer drops it. `RowFollower` only feeds the console progress line, so it skips damaged
rows instead of ending a run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmrun.errors import InputError, short_repr
from vlmrun.run.directory import RunDirectory
from vlmrun.run.rows import NUMBER_KEYS, StepRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TornRow:
    """An unterminated last line a reader skipped: a row a killed writer left half-written."""

    path: Path
    line: int
    step: int | None  # the step it names, when the writer got that far

    def describe(self) -> str:
        of = f" (step {self.step})" if self.step is not None else ""
        return f"{self.path}: line {self.line}{of} is a row a killed writer left half-written: skipped"


_STEP = re.compile(rb'"step"\s*:\s*(\d+)\s*[,}]')


class MetricsLog:
    """Appends rows with one write(2) each; on open, drops a torn last line left by a killed writer."""

    def __init__(self, path: Path):
        self.path = Path(path)
        _drop_torn_tail(self.path)

    def append(self, row: StepRow) -> None:
        data = (json.dumps(row.to_json(), sort_keys=False) + "\n").encode()
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


def read_rows(path: Path, torn: list[TornRow] | None = None) -> list[dict]:
    """Every row, in file order; [] when there is no file. Raises InputError naming the file and line
    for a damaged row; an unterminated last line (a killed writer's) is skipped, and added to `torn`."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        with open(p, "rb") as f:
            return list(_rows(f, p, torn if torn is not None else []))
    except OSError as e:
        raise InputError("metrics", str(p), message=f"{p}: cannot read it: {e.strerror or e}") from None


def history(path: Path, torn: list[TornRow] | None = None) -> dict[int, dict]:
    """step -> the row of the latest attempt that wrote that step (InputError and `torn` as `read_rows`)."""
    out: dict[int, dict] = {}
    for row in read_rows(path, torn):
        prev = out.get(row["step"])
        if prev is None or row.get("attempt", 0) >= prev.get("attempt", 0):
            out[row["step"]] = row
    return out


def last_metrics(rd: RunDirectory, recipe=None, tail_bytes: int = 65536) -> dict:
    """{last_step, loss} of the newest row of the run's metrics file, reading only the file's tail.

    `recipe` names the file (`logger.metrics_file`; default metrics.jsonl). Both None when there is no
    row yet; InputError naming the file when the newest row is damaged.
    """
    path = rd.metrics_file(recipe)
    none = {"last_step": None, "loss": None}
    if not path.is_file():
        return none
    try:
        with open(path, "rb") as f:
            line = _last_line(f, tail_bytes)
    except OSError as e:
        raise InputError("metrics", str(path), message=f"{path}: cannot read it: {e.strerror or e}") from None
    if line is None:
        return none
    row = _row(line, path, "its last row")
    return {"last_step": row["step"], "loss": row.get("loss")}


class RowFollower:
    """Reads rows appended to metrics.jsonl since the last call (for the console progress line).

    Skips (with a warning) a row that is damaged: the display must not end the run it shows.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.is_file() else 0

    def new_rows(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        rows = []
        for line in complete.splitlines():
            if not line.strip():
                continue
            try:
                rows.append(_row(line, self.path, "a new row"))
            except InputError as e:
                log.warning("skipped a row of the progress display: %s", e)
        return rows


def _rows(f, path: Path, torn: list[TornRow]) -> Iterator[dict]:
    for lineno, line in enumerate(f, start=1):
        if not line.endswith(b"\n"):  # the writer was killed mid-row: skip it unless it is whole
            try:
                yield _row(line, path, f"line {lineno}")
            except InputError:
                step = _STEP.search(line)
                torn.append(TornRow(path, lineno, int(step.group(1)) if step else None))
            return
        if line.strip():
            yield _row(line, path, f"line {lineno}")


def _last_line(f, tail_bytes: int) -> bytes | None:
    """The newest complete (newline-terminated) non-blank line, reading back from the end as far as needed."""
    size = f.seek(0, os.SEEK_END)
    window = tail_bytes
    while True:
        start = max(0, size - window)
        f.seek(start)
        lines = f.read(size - start).split(b"\n")
        lines.pop()  # after the last newline: empty, or a row a killed writer left unterminated
        if start > 0:
            lines.pop(0)  # cut by the seek
        for line in reversed(lines):
            if line.strip():
                return line
        if start == 0:
            return None
        window *= 4


def _row(line: bytes, path: Path, where: str) -> dict:
    """One row, checked; InputError "<path>: <where>: <what is wrong>" when it is damaged."""
    try:
        text = line.decode()
    except UnicodeDecodeError:
        raise _damaged(path, where, "not UTF-8 text") from None
    try:
        row = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise _damaged(path, where, f"not JSON: {short_repr(text.strip(), 50)}") from None
    if not isinstance(row, dict):
        raise _damaged(path, where, f"a row is a JSON object, not {short_repr(row, 50)}")
    if "step" not in row:
        raise _damaged(path, where, "the row has no step")
    for key in ("step", "attempt"):
        if key in row and not _whole(row[key]):
            raise _damaged(path, where, f"{key} is {short_repr(row[key], 40)}, not a whole number >= 0")
    for key in NUMBER_KEYS:  # numbers or null ("not measured"); other keys are carried as they are
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _damaged(path, where, f"{key} is {short_repr(value, 40)}, not a number")
    return row


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _damaged(path: Path, where: str, what: str) -> InputError:
    return InputError("metrics", str(path), message=f"{path}: {where}: {what} (a damaged metrics file)")
