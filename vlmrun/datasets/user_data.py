"""`vlmrun data prepare`: a user's conversations as an Energon data set that a recipe's `data.path` names.

On disk (`out/`), laid out as `vlmrun data clevr` lays out its set:

    train-000000.tar ...  samples <key>.json (the record) + <key>.<i>.<ext> (image i), key "train-0000042"
    val-000000.tar ...
    *.tar.idx, .nv-meta/  Energon's index and metadata (CrudeWebdataset, subflavors = CONVERSATION_SUBFLAVORS)
    prepare.json          the summary and the file sizes; written last

1. Records are the conversation format of `vlmrun.data.cookers` (one `{"type": "image", "ref": "0.jpg"}`
   part per image, `media` with each image's size) plus the source row's `id`, which the loader keeps
   as an annotation. Images are decoded once with Pillow, to refuse what does not decode and to read
   the size; the bytes stored are the source's own, under the ref `<i>.<ext>` of the format Pillow found.
2. Split: by a column of the source (`--split-column`: train/val), or by `val_ratio` from a hash of the
   row id and `seed` (SHA-256, not Python's salted `hash`): the same id and seed give the same split on
   every run and machine, whatever else the source holds.
3. Rows that cannot be used are counted by reason (`vlmrun.datasets.user_rows.REASONS`) with the first
   few ids; past the budget (`BadRowBudget`, like the loader's `data.error_tolerance`) the conversion
   stops with an InputError naming the count and the first rows.
4. Everything is written into a hidden sibling of `out` that is renamed to `out` at the end, so a
   failure, Ctrl-C, SIGTERM or SIGHUP (the CLI turns them into an exception: cli/data.py) leaves `out`
   as it was and the sibling removed, and a folder with `prepare.json` is a complete set.
   The same source and arguments give byte-identical shards (fixed tar headers; Energon's
   `.nv-meta/index.uuid` is random).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlmrun.datasets.conversation_shards import SplitWriter, encode_row
from vlmrun.datasets.energon_prepare import prepare_crude_webdataset
from vlmrun.datasets.formats import CONVERSATION_SUBFLAVORS
from vlmrun.datasets.marker import read_marker, write_marker
from vlmrun.datasets.user_readers import RowSource, SourceSpec, open_source
from vlmrun.datasets.user_rows import REASONS, BadRow, Row
from vlmrun.errors import InputError

MARKER = "prepare.json"
SPLITS = ("train", "val")
DEFAULT_VAL_RATIO = 0.05
_FORMAT_VERSION = 1
_FIRST_ROWS = 5  # bad rows named per reason
_PROGRESS_EVERY = 32

Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class BadRowBudget:
    """How many rows may be skipped: a count, or a fraction of the rows read. `text` is as given."""

    text: str
    count: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> BadRowBudget:
        """`16` (rows), `0.01` or `1%` (of the rows read); InputError on --max-bad-rows otherwise."""
        value = text.strip()
        try:
            if value.endswith("%"):
                fraction = float(value[:-1]) / 100
            elif value.isdigit():
                return cls(text=value, count=int(value))
            else:
                fraction = float(value)
        except ValueError:
            fraction = -1.0
        if not 0 <= fraction < 1:
            raise InputError("--max-bad-rows", text, "give a count (16) or a fraction of the rows read (0.01 or 1%)")
        return cls(text=value, fraction=fraction)

    def limit(self, rows: int) -> int:
        return self.count if self.count is not None else int(self.fraction * rows)


@dataclass
class _Tally:
    """What the conversion has seen so far."""

    rows_read: int = 0
    samples: Counter = field(default_factory=Counter)
    images: int = 0
    text_only: int = 0
    bad: Counter = field(default_factory=Counter)
    first_bad: dict[str, list[BadRow]] = field(default_factory=dict)

    def count_bad(self, row: BadRow) -> None:
        self.bad[row.reason] += 1
        kept = self.first_bad.setdefault(row.reason, [])
        if len(kept) < _FIRST_ROWS:
            kept.append(row)

    def bad_by_reason(self) -> dict[str, dict]:
        return {
            reason: {
                "count": self.bad[reason],
                "what": REASONS[reason],
                "rows": [b.row_id for b in self.first_bad[reason]],
                "first": self.first_bad[reason][0].detail,
            }
            for reason in REASONS
            if self.bad[reason]
        }


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare_user_data` wrote: counts per split, images, bad rows by reason; `to_json` for --json."""

    path: Path
    data: dict

    def to_json(self) -> dict:
        return {"path": str(self.path), **self.data}


def split_of(row_id: str, *, seed: int, val_ratio: float) -> str:
    """train or val for a row id (module doc)."""
    digest = hashlib.sha256(f"vlmrun-split/{seed}/{row_id}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_ratio * 2**64 else "train"


def prepare_user_data(
    spec: SourceSpec,
    out: Path,
    *,
    val_ratio: float | None = None,
    seed: int = 0,
    budget: BadRowBudget,
    samples_per_shard: int = 1024,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> PrepareSummary:
    """Convert the rows of `spec` into the data set `out` (module doc).

    `out` must be missing or empty, or `overwrite` set (it is then replaced whole, at the end). Raises
    `InputError` naming the flag or argument for bad arguments, and `--max-bad-rows` past the budget;
    `out` is unchanged then. `progress(done, total)` is called every few rows (total None: unknown).
    """
    out = Path(out)
    _check_out(out, spec, overwrite)
    ratio = _val_ratio(val_ratio, spec)
    if samples_per_shard < 1:
        raise InputError("--samples-per-shard", samples_per_shard, "must be at least 1")
    source = open_source(spec)
    staging = _staging(out)
    try:
        tally = _convert(source, staging, spec, ratio, seed, budget, samples_per_shard, progress)
        present = [split for split in SPLITS if tally.samples[split]]
        patterns = {split: rf"{split}-[0-9]+\.tar$" for split in present}
        prepare_crude_webdataset(staging, split_patterns=patterns, subflavors=dict(CONVERSATION_SUBFLAVORS))
        data = _summary(spec, tally, budget, ratio, seed)
        write_marker(staging, MARKER, _FORMAT_VERSION, data)
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PrepareSummary(path=out, data=data)


def read_prepared(out: Path) -> dict | None:
    """The summary of the complete set `prepare_user_data` wrote at `out`, or None (missing, torn, not ours)."""
    return read_marker(Path(out), MARKER, _FORMAT_VERSION)


def _check_out(out: Path, spec: SourceSpec, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError("out", str(out), message=f"out: {out} is a file; give a folder that is missing or empty")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise InputError(
            "out",
            str(out),
            message=f"out: {out} exists and is not empty; choose another folder, or pass --overwrite to replace it",
        )
    inputs = (spec.path.resolve(), spec.root.resolve())
    if any(p == out.resolve() or out.resolve() in p.parents for p in inputs):
        raise InputError("out", str(out), "holds the source (SRC or its images); --overwrite would delete it")


def _val_ratio(val_ratio: float | None, spec: SourceSpec) -> float:
    if spec.split_column is not None:
        if val_ratio is not None:
            raise InputError("--val-ratio", val_ratio, "give --val-ratio or --split-column, not both")
        return 0.0
    ratio = DEFAULT_VAL_RATIO if val_ratio is None else val_ratio
    if not 0 <= ratio < 1:
        raise InputError("--val-ratio", val_ratio, "must be at least 0 and below 1")
    return ratio


def _staging(out: Path) -> Path:
    """A new hidden sibling of `out`, made with the user's umask (mkdtemp's 0700 would hide the set from
    the other users of a shared cluster)."""
    staging = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        return staging
    except OSError as e:
        raise InputError("out", str(out), message=f"out: cannot make {out}: {e.strerror or e}") from None


def _convert(
    source: RowSource,
    folder: Path,
    spec: SourceSpec,
    ratio: float,
    seed: int,
    budget: BadRowBudget,
    per_shard: int,
    progress: Progress | None,
) -> _Tally:
    tally = _Tally()
    writers = {split: SplitWriter(folder, split, per_shard) for split in SPLITS}
    limit = budget.limit(source.total) if source.total is not None else None
    try:
        for item in source.rows:
            tally.rows_read += 1
            try:
                row = _usable(item, spec)
                split = row.split or split_of(row.id, seed=seed, val_ratio=ratio)
                members, images = encode_row(row)
            except BadRow as bad:
                tally.count_bad(bad)
                if limit is not None and tally.bad.total() > limit:
                    raise _over_budget(tally, budget, limit) from None
            else:
                writers[split].add(members)
                tally.samples[split] += 1
                tally.images += images
                tally.text_only += images == 0
            if progress is not None and (tally.rows_read % _PROGRESS_EVERY == 0):
                progress(tally.rows_read, source.total)
    finally:
        for writer in writers.values():
            writer.close()
    if progress is not None:
        progress(tally.rows_read, source.total)
    if tally.bad.total() > budget.limit(tally.rows_read):
        raise _over_budget(tally, budget, budget.limit(tally.rows_read))
    if not tally.samples["train"]:
        raise InputError(
            "src",
            str(spec.path),
            message=f"src: no usable row for the train split ({_counts(tally)}): nothing to write",
        )
    return tally


def _usable(item: Row | BadRow, spec: SourceSpec) -> Row:
    if isinstance(item, BadRow):
        raise item
    if spec.split_column is not None and item.split is None:
        raise BadRow("malformed", f"no {spec.split_column!r} value (train or val)", item.id)
    return item


def _over_budget(tally: _Tally, budget: BadRowBudget, limit: int) -> InputError:
    first = "; ".join(
        f"{reason} {info['count']} ({', '.join(info['rows'])}: {info['first']})"
        for reason, info in tally.bad_by_reason().items()
    )
    return InputError(
        "--max-bad-rows",
        budget.text,
        message=f"--max-bad-rows: {tally.bad.total()} bad rows after reading {tally.rows_read}, more than "
        f"--max-bad-rows {budget.text} allows ({limit}): {first}; fix those rows or raise --max-bad-rows",
    )


def _counts(tally: _Tally) -> str:
    return f"{tally.rows_read} rows read, {tally.bad.total()} bad, {tally.samples['val']} for val"


def _summary(spec: SourceSpec, tally: _Tally, budget: BadRowBudget, ratio: float, seed: int) -> dict:
    split = {"column": spec.split_column} if spec.split_column else {"val_ratio": ratio, "seed": seed}
    return {
        "source": str(spec.path.resolve()),
        "format": spec.format,
        "rows_read": tally.rows_read,
        "train": tally.samples["train"],
        "val": tally.samples["val"],
        "images": tally.images,
        "text_only": tally.text_only,
        "bad_rows": tally.bad.total(),
        "max_bad_rows": budget.limit(tally.rows_read),
        "bad_rows_by_reason": tally.bad_by_reason(),
        "split": split,
    }


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an existing `out` (empty, or replaced under --overwrite) is moved aside first."""
    if not out.exists():
        os.rename(staging, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, aside)  # onto the empty folder just made: POSIX allows it
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
