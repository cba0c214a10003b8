"""Read a user's data set row by row: LLaVA JSON/JSONL, parquet files, or existing WebDataset shards.

`open_source(spec)` checks the flags against the format and the source (an `InputError` naming the
flag) and returns a `RowSource`: how many rows to expect (None when only reading tells) and an iterator
of `Row`s and `BadRow`s in the source's order. A row's id is its own (`id` field, `--id-column`, the
WebDataset key) or, where it has none, its position (`#17`, `file.parquet#17`).

A LLaVA row's turns are its `conversations` (`{"from", "value"}`), or its `messages` (`{"role",
"content"}`, the chat format of OpenAI and TRL, images under `images`). Text is UTF-8 in every format:
a LLaVA file that is not is refused naming its line, a WebDataset member makes its row bad naming the
member (parquet strings are UTF-8 by the format). A parquet question or answer column holds text, or
integers, written as their digits; any other type is refused naming the column and the type.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from vlmrun.datasets.user_rows import BadRow, Row, make_row
from vlmrun.errors import InputError

FORMATS = ("llava", "parquet", "webdataset")
#: `--field` names of the webdataset format: what each member extension holds.
WEBDATASET_FIELDS = ("image", "question", "answer", "conversations", "id")
_BATCH_ROWS = 256


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """Where the rows are and how to read them: the flags of `vlmrun data prepare`, by format."""

    format: str
    path: Path
    image_root: Path | None = None
    image_column: str | None = None
    messages_column: str | None = None
    question_column: str | None = None
    answer_column: str | None = None
    id_column: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    split_column: str | None = None

    @property
    def root(self) -> Path:
        """The folder relative image paths start from: --image-root, else SRC's folder."""
        if self.image_root is not None:
            return self.image_root
        return self.path if self.path.is_dir() else self.path.parent


class RowSource(NamedTuple):
    total: int | None
    rows: Iterator[Row | BadRow]


def parse_fields(items: list[str]) -> dict[str, str]:
    """`--field NAME=EXT` arguments as {name: ext}; InputError on --field for anything else."""
    fields: dict[str, str] = {}
    for item in items:
        name, sep, ext = item.partition("=")
        if not sep or name.strip() not in WEBDATASET_FIELDS or not ext.strip():
            raise InputError("--field", item, f"use NAME=EXT with NAME one of {', '.join(WEBDATASET_FIELDS)}")
        fields[name.strip()] = ext.strip()
    return fields


def open_source(spec: SourceSpec) -> RowSource:
    """The rows of `spec` (module doc); `InputError` naming the flag for flags that do not fit."""
    if spec.format not in FORMATS:
        raise InputError("--format", spec.format, f"use one of {', '.join(FORMATS)}")
    if not spec.path.exists():
        raise _bad_src(spec, "does not exist")
    if spec.image_root is not None and not spec.image_root.is_dir():
        raise InputError("--image-root", str(spec.image_root), "must be a folder")
    _check_flags(spec)
    return {"llava": _llava, "parquet": _parquet, "webdataset": _webdataset}[spec.format](spec)


def _bad_src(spec: SourceSpec, what: str) -> InputError:
    return InputError("src", str(spec.path), message=f"src: {spec.path} {what}")


def _check_flags(spec: SourceSpec) -> None:
    own = {
        "parquet": ("image_column", "messages_column", "question_column", "answer_column", "id_column"),
        "webdataset": ("fields",),
    }
    for fmt, names in own.items():
        for name in names:
            if getattr(spec, name) and spec.format != fmt:
                flag = "--field" if name == "fields" else f"--{name.replace('_', '-')}"
                raise InputError(flag, getattr(spec, name), f"is a flag of --format {fmt}, not {spec.format}")


# ---------------------------------------------------------------- LLaVA JSON / JSONL


def _llava(spec: SourceSpec) -> RowSource:
    if not spec.path.is_file():
        raise _bad_src(spec, "is not a file: --format llava reads one .json (a list of rows) or .jsonl file")
    try:
        data = spec.path.read_bytes()
    except OSError as e:
        raise InputError("src", str(spec.path), message=f"src: cannot read {spec.path}: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError("src", str(spec.path), message=f"src: {spec.path} {_not_utf8(data, e)}") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise InputError("src", str(spec.path), message=f"src: {spec.path} is not valid JSON: {e}") from None
        return RowSource(len(items), _llava_rows(spec, enumerate(items)))
    if _one_object(text):
        raise _bad_src(spec, "holds one JSON object; LLaVA data is a list of rows, or JSONL")
    lines = [(i, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    return RowSource(len(lines), _llava_rows(spec, ((i, _json_line(line)) for i, line in lines), jsonl=True))


def _one_object(text: str) -> bool:
    """Whether `text` is one JSON object spread over several lines (not JSONL, not a list)."""
    if text.count("\n") < 2:
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as e:
        return BadRow("malformed", f"not a JSON line ({e})")


def _llava_rows(spec: SourceSpec, items, jsonl: bool = False) -> Iterator[Row | BadRow]:
    where = "line" if jsonl else "#"
    for index, item in items:
        fallback = f"{where} {index + 1}" if jsonl else f"#{index}"
        if isinstance(item, BadRow):
            yield item.of(fallback)
            continue
        if not isinstance(item, dict):
            yield BadRow("malformed", "a row must be a JSON object", fallback)
            continue
        row_id = str(item["id"]) if item.get("id") is not None else fallback
        split = item.get(spec.split_column) if spec.split_column else None
        if "conversations" not in item and "messages" not in item:
            keys = ", ".join(repr(k) for k in list(item)[:8]) or "none"
            yield BadRow(
                "malformed",
                f"no turns: a row has 'conversations' (LLaVA's from/value turns) or "
                f"'messages' (role/content turns); this one has {keys}",
                row_id,
            )
            continue
        turns = item["conversations"] if "conversations" in item else item["messages"]
        images = item["image"] if "image" in item else item.get("images")
        yield _row(row_id, turns, images, spec.root, split)


def _row(row_id: str, turns: Any, images: Any, root: Path, split: Any = None) -> Row | BadRow:
    try:
        return make_row(row_id, turns, images, root, split)
    except BadRow as e:
        return e


# ---------------------------------------------------------------- parquet


def _parquet(spec: SourceSpec) -> RowSource:
    files = sorted(spec.path.rglob("*.parquet")) if spec.path.is_dir() else [spec.path]
    if not files:
        raise _bad_src(spec, "holds no .parquet file: --format parquet reads a .parquet file or a folder of them")
    if spec.messages_column is None and not (spec.question_column and spec.answer_column):
        raise InputError(
            "--messages-column",
            message="--messages-column: --format parquet needs --messages-column, or --question-column and "
            "--answer-column",
        )
    if spec.messages_column and (spec.question_column or spec.answer_column):
        raise InputError("--messages-column", spec.messages_column, "give it or --question-column/--answer-column")
    wanted = _parquet_columns(spec)
    total = 0
    for file in files:
        meta = _parquet_file(file)
        names = set(meta.schema_arrow.names)
        for flag, column in wanted.items():
            if column not in names:
                raise InputError(flag, column, f"{file.name} has the columns: {', '.join(sorted(names))}")
            if flag in ("--question-column", "--answer-column"):
                _check_text_column(flag, column, meta.schema_arrow.field(column).type, file)
        total += meta.metadata.num_rows
    return RowSource(total, _parquet_rows(spec, files, list(dict.fromkeys(wanted.values()))))


def _parquet_file(file: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise InputError("src", str(file), message=f"src: {file} is not a parquet file Arrow can read: {e}") from None


def _check_text_column(flag: str, column: str, kind, file: Path) -> None:
    """A question or answer column holds text, or integers (written as their digits: lossless)."""
    import pyarrow as pa

    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind)):
        raise InputError(
            flag,
            column,
            message=f"{flag}: column {column!r} of {file.name} holds {kind}, not text: give a text column (or "
            "integers, which are written as their digits), e.g. cast it to string first",
        )


def _parquet_columns(spec: SourceSpec) -> dict[str, str]:
    flags = {
        "--image-column": spec.image_column,
        "--messages-column": spec.messages_column,
        "--question-column": spec.question_column,
        "--answer-column": spec.answer_column,
        "--id-column": spec.id_column,
        "--split-column": spec.split_column,
    }
    return {flag: column for flag, column in flags.items() if column}


def _parquet_rows(spec: SourceSpec, files: list[Path], columns: list[str]) -> Iterator[Row | BadRow]:
    import pyarrow.parquet as pq

    for file in files:
        index = 0
        for batch in pq.ParquetFile(file).iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            for item in batch.to_pylist():
                fallback = f"{file.name}#{index}" if len(files) > 1 else f"#{index}"
                index += 1
                row_id = str(item[spec.id_column]) if spec.id_column and item[spec.id_column] is not None else fallback
                images = item[spec.image_column] if spec.image_column else None
                split = item[spec.split_column] if spec.split_column else None
                yield _row(row_id, _parquet_turns(spec, item), images, spec.root, split)


def _parquet_turns(spec: SourceSpec, item: dict) -> Any:
    if spec.messages_column is None:
        return [
            {"role": "user", "content": _digits(item[spec.question_column])},
            {"role": "assistant", "content": _digits(item[spec.answer_column])},
        ]
    turns = item[spec.messages_column]
    if isinstance(turns, str):  # messages stored as a JSON string
        try:
            return json.loads(turns)
        except ValueError:
            return None
    return turns


def _digits(value: Any) -> Any:
    """An integer of a question or answer column as its digits (`_check_text_column`); text as it is."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# ---------------------------------------------------------------- WebDataset shards


def _webdataset(spec: SourceSpec) -> RowSource:
    shards = sorted(spec.path.glob("*.tar")) if spec.path.is_dir() else [spec.path]
    if not shards or any(s.suffix != ".tar" for s in shards):
        raise _bad_src(spec, "holds no .tar shard: --format webdataset reads a folder of .tar shards")
    unknown = next((name for name in spec.fields if name not in WEBDATASET_FIELDS), None)
    if unknown is not None:
        raise InputError("--field", unknown, f"field names: {', '.join(WEBDATASET_FIELDS)} (as NAME=EXT)")
    has_qa = "question" in spec.fields and "answer" in spec.fields
    if ("conversations" in spec.fields) == has_qa:
        given = ", ".join(f"{k}={v}" for k, v in spec.fields.items()) or "none"
        raise InputError(
            "--field",
            given,
            message=f"--field: {given} given; map either conversations=EXT (a JSON member) or question=EXT and "
            "answer=EXT, e.g. --field image=jpg --field question=txt --field answer=answer.txt",
        )
    return RowSource(None, _webdataset_rows(spec, shards))


def _webdataset_rows(spec: SourceSpec, shards: list[Path]) -> Iterator[Row | BadRow]:
    images = [ext.strip() for ext in spec.fields.get("image", "").split(",") if ext.strip()]
    for shard in shards:
        for key, members in _samples(shard):
            yield _webdataset_row(spec, shard, key, members, images)


def _webdataset_row(spec: SourceSpec, shard: Path, key: str, members: dict, images: list[str]) -> Row | BadRow:
    fields = spec.fields

    def text(ext: str | None) -> str | None:
        return _text(members.get(ext), f"member {key}.{ext} of {shard.name}")

    try:
        row_id = text(fields["id"]) if "id" in fields and fields["id"] in members else key
        split = text(spec.split_column) if spec.split_column else None
        if "conversations" in fields:
            turns = _conversations(text(fields["conversations"]))
        else:
            q, a = (text(fields[name]) for name in ("question", "answer"))
            turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    except BadRow as bad:
        return bad.of(key)
    return _row(row_id, turns, [members[ext] for ext in images if ext in members], spec.root, split)


def _samples(shard: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of each sample of a shard, in order (members of a key are adjacent)."""
    key, members = None, {}
    try:
        tar = tarfile.open(shard)
    except (tarfile.TarError, OSError) as e:
        raise InputError("src", str(shard), message=f"src: {shard} is not a tar file Python can read: {e}") from None
    with tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, name = member.name.rpartition("/")
            stem, _, ext = name.partition(".")
            this = f"{folder}/{stem}" if folder else stem
            if this != key and key is not None:
                yield key, members
                members = {}
            key = this
            members[ext] = tar.extractfile(member).read()
    if key is not None:
        yield key, members


def _text(data: bytes | None, where: str) -> str | None:
    """A member's text; `BadRow` (not_utf8) naming `where` when it is not UTF-8 (module doc)."""
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRow("not_utf8", f"{where} {_not_utf8(data, e)}") from None


def _not_utf8(data: bytes, e: UnicodeDecodeError) -> str:
    """Where `data` stops being UTF-8, and what to do: vlmrun never guesses an encoding."""
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
    return (
        f"is not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column {column}): vlmrun reads text as "
        "UTF-8 and never guesses an encoding; convert it first (e.g. iconv -f latin1 -t utf-8)"
    )


def _conversations(text: str | None) -> Any:
    """The turns of a JSON member: a list of turns, or an object with `conversations` or `messages`."""
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    if isinstance(value, dict):
        return value.get("conversations", value.get("messages"))
    return value
