"""A user's multimodal conversation as one `Row`, or the reason it is a `BadRow`.

The readers (`vlmrun.datasets.user_readers`) hand every source row to `make_row` with its turns as
found (`{"from", "value"}` as LLaVA writes them, or `{"role", "content"}`) and its images as found
(bytes, a path, a Hugging Face image struct `{"bytes", "path"}`, or a list of those). What comes out:

1. Roles human/user, gpt/assistant and system become user, assistant and system.
2. Content is a string, or a list of parts (`{"type": "text", "text"}`, `{"type": "image"}`). In a
   string, each `<image>` placeholder stands for the next image. The placeholders of the user turns
   must match the images one to one, in order; a row with images and no placeholder gets them before
   the first user text, as LLaVA does. Text around a placeholder is stripped; empty pieces are dropped.
3. Images stay sources (`ImageSource`: bytes in hand or a file to read); they are never fetched: a URL
   (`http://`, `s3://`, ...) makes the row bad, and so does a path that leads out of the image root
   (`--image-root`, default SRC's folder: `../..`, or an absolute path elsewhere; judged on the path as
   written, so a link the user placed inside the root is followed). The writer decodes them, so a
   missing or undecodable file is found there, as a `BadRow` too.
4. Text is UTF-8: a reader refuses other bytes naming where they are, and never guesses an encoding.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLACEHOLDER = "<image>"

#: Why a row cannot be used, as the summary names it.
REASONS = {
    "missing_image": "image file not found",
    "undecodable_image": "image that Pillow cannot decode",
    "url_image": "image given as a URL (never downloaded)",
    "image_outside_root": "image path outside --image-root (never read)",
    "not_utf8": "text that is not UTF-8 (no encoding is guessed)",
    "no_assistant_turn": "no assistant (gpt) answer at the end",
    "placeholder_mismatch": "<image> placeholders that do not match the images",
    "empty_text": "a turn with neither text nor image",
    "malformed": "not a row of the format",
}

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_SPLITS = {"train": "train", "val": "val", "validation": "val"}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class BadRow(Exception):
    """A row that cannot be used: `reason` is a key of `REASONS`, `detail` says what is wrong with it."""

    def __init__(self, reason: str, detail: str, row_id: str = "?"):
        super().__init__(f"row {row_id}: {detail}")
        self.reason, self.detail, self.row_id = reason, detail, row_id

    def of(self, row_id: str) -> BadRow:
        """The same problem, named by the row it belongs to."""
        return BadRow(self.reason, self.detail, row_id)


@dataclass(frozen=True)
class ImageSource:
    """One image of a row: its encoded bytes (`data`), or the file that holds them (`path`)."""

    data: bytes | None = None
    path: Path | None = None

    def read(self) -> bytes:
        """The encoded bytes; `BadRow` (missing_image) when the file cannot be read."""
        if self.data is not None:
            return self.data
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            raise BadRow("missing_image", f"image file {self.path} not found") from None
        except OSError as e:
            raise BadRow("missing_image", f"cannot read image file {self.path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Row:
    """One usable conversation. `messages` are in the record format of `vlmrun.data.cookers` except that
    an image part is `{"type": "image", "image": i}`, an index into `images`; `split` is train, val or
    None (the writer decides)."""

    id: str
    messages: list[dict]
    images: list[ImageSource] = field(default_factory=list)
    split: str | None = None


def make_row(row_id: str, turns: Any, images: Any, image_root: Path, split: Any = None) -> Row:
    """The `Row` of one source row (module doc); raises `BadRow` naming `row_id`."""
    try:
        sources = image_sources(images, image_root)
        messages = _messages(turns, len(sources))
        return Row(id=row_id, messages=messages, images=sources, split=split_name(split))
    except BadRow as e:
        raise e.of(row_id) from None


def image_sources(value: Any, image_root: Path) -> list[ImageSource]:
    """The images of a row: None (none), bytes, a path string, an `{"bytes", "path"}` struct, or a list."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_image_source(item, image_root) for item in items]


def split_name(value: Any) -> str | None:
    """train or val from a split column's value (`validation` is val); None when there is no value."""
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in _SPLITS:
        raise BadRow("malformed", f"split {value!r} is not train or val")
    return _SPLITS[value.strip().lower()]


def _image_source(item: Any, image_root: Path) -> ImageSource:
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        item = data if data is not None else path
    if isinstance(item, (bytes, bytearray, memoryview)):
        return ImageSource(data=bytes(item))
    if not isinstance(item, str) or not item.strip():
        raise BadRow("malformed", f"an image must be bytes or a path, got {str(item)[:60]!r}")
    if _URL.match(item.strip()):
        raise BadRow("url_image", f"image {item.strip()[:120]} is a URL; vlmrun never downloads: give a local file")
    path = Path(item.strip()).expanduser()
    return ImageSource(path=_inside(path if path.is_absolute() else image_root / path, item.strip(), image_root))


def _inside(path: Path, written: str, image_root: Path) -> Path:
    """`path` when, as written, it stays inside `image_root`; `BadRow` (image_outside_root) otherwise."""
    root = os.path.normpath(os.path.abspath(image_root))
    full = os.path.normpath(os.path.abspath(path))
    if os.path.commonpath([root, full]) != root:
        raise BadRow(
            "image_outside_root",
            f"image {written[:200]} is outside --image-root {root} (it leads to {full}); give an --image-root "
            "that holds the images",
        )
    return path


def _messages(turns: Any, images: int) -> list[dict]:
    """Our messages from the source's turns, with `images` images to place (module doc)."""
    if not isinstance(turns, (list, tuple)) or not turns:
        raise BadRow("malformed", "no conversation turns")
    messages = [_message(turn) for turn in turns]
    placed = sum(part["type"] == "image" for m in messages for part in m["content"])
    stray = next((m["role"] for m in messages if m["role"] != "user" and _has_image(m)), None)
    if stray is not None:
        raise BadRow("placeholder_mismatch", f"an {PLACEHOLDER} placeholder in the {stray}'s turn, not the user's")
    if placed == 0 and images:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise BadRow("placeholder_mismatch", f"{images} image(s) but no user turn to show them in")
        first_user["content"][:0] = [{"type": "image"} for _ in range(images)]
    elif placed != images:
        raise BadRow("placeholder_mismatch", f"{placed} {PLACEHOLDER} placeholder(s) but {images} image(s)")
    index = iter(range(images))
    for message in messages:
        message["content"] = [{**p, "image": next(index)} if p["type"] == "image" else p for p in message["content"]]
    _check_turns(messages)
    return messages


def _message(turn: Any) -> dict:
    if not isinstance(turn, dict):
        raise BadRow("malformed", f"a turn must be an object, got {str(turn)[:60]!r}")
    # A parquet struct column holds every key of every row's turns: an absent key reads as None.
    role = turn["from"] if turn.get("from") is not None else turn.get("role")
    content = turn["value"] if turn.get("value") is not None else turn.get("content")
    if role not in _ROLES:
        raise BadRow("malformed", f"turn role {str(role)[:40]!r} is not one of {', '.join(_ROLES)}")
    return {"role": _ROLES[role], "content": _parts(content)}


def _parts(content: Any) -> list[dict]:
    """Text and image parts of a turn's content: a string with placeholders, or a list of parts."""
    if isinstance(content, str):
        pieces = content.split(PLACEHOLDER)
        parts: list[dict] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        return parts
    if isinstance(content, (list, tuple)):
        return [part for item in content for part in _part(item)]
    raise BadRow("malformed", f"turn content must be text or a list of parts, got {type(content).__name__}")


def _part(item: Any) -> list[dict]:
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "image":
        return [{"type": "image"}]
    if kind == "text" and isinstance(item.get("text"), str):
        return _parts(item["text"])
    raise BadRow("malformed", f"unsupported content part {str(item)[:60]!r}")


def _has_image(message: dict) -> bool:
    return any(part["type"] == "image" for part in message["content"])


def _check_turns(messages: list[dict]) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn", "no assistant (gpt) turn")
    if messages[-1]["role"] != "assistant":
        raise BadRow("no_assistant_turn", f"the last turn is the {messages[-1]['role']}'s, not an answer")
    empty = next((m["role"] for m in messages if not m["content"]), None)
    if empty is not None:
        raise BadRow("empty_text", f"a {empty} turn with neither text nor image")
    if any(not any(p["type"] == "text" for p in m["content"]) for m in messages if m["role"] == "assistant"):
        raise BadRow("empty_text", "an assistant turn with no text")
