"""Cookers: stateless functions from a raw WebDataset sample to a model-neutral `Conversation`.

A crude sample arrives as Energon hands it over when the task encoder has no decoder: a dict of
raw bytes per tar member extension (`json`, `jpg`, ...) plus `__key__`, `__restore_key__`,
`__sources__`. The `conversation` cooker reads our CLEVR format (see `vlmrun.datasets.clevr`):

    {"messages": [{"role": "user", "content": [{"type": "image", "ref": "jpg"},
                                               {"type": "text", "text": "..."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "2"}]}],
     "media": [{"ref": "jpg", "modality": "image", "width": 112, "height": 112}]}

A media part of a message points at a tar member by its extension (`ref`); the cooker rewrites the
parts to `{"type": "image", "media": i}` and keeps each referenced member's bytes as stored.

Media stay encoded until the task encoder needs pixels (`media_pixels`): Energon's shuffle buffer
sits between cooking and encoding, and holding `data.shuffle_buffer` decoded images there costs
memory per worker (10 MB at 224 px, 200 MB at 1 MP) and cache misses, where 10 KB JPEGs cost
nothing. Decoding is Pillow straight from bytes to a uint8 CHW tensor (no float conversion: the
processor rescales and normalizes anyway; no draft/reduce mode, which would change the pixels the
processor sees).

A sample that cannot be cooked or decoded raises `MalformedSample` naming its key; Energon's error
handler (see `vlmrun.data.error_budget`) counts and skips it, from either stage.
"""

from __future__ import annotations

import io
import json
from dataclasses import field
from typing import Any

import numpy as np
import torch
from megatron.energon import Cooker, Sample, edataclass, stateless

from vlmrun.data.components import COOKERS


class MalformedSample(ValueError):
    """A sample this cooker or task encoder cannot use; the message starts with its key."""


@edataclass
class MediaItem:
    """One media item: `data` is the member's bytes as stored (e.g. JPEG), or already decoded pixels
    (a uint8 tensor (C, H, W) for an image); `media_pixels` gives the pixels either way."""

    modality: str
    data: bytes | torch.Tensor
    metadata: dict[str, Any]


@edataclass
class Conversation(Sample):
    """A model-neutral conversation: messages whose content parts are text or `{"type": "image",
    "media": i}` (an index into `media`), in the order the processor must see the media."""

    messages: list[dict[str, Any]]
    media: list[MediaItem]
    #: The record's other top-level text fields (CLEVR: its question `template`), for per-kind metrics.
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def answer(self) -> str:
        """Text of the last assistant message: the reference answer of a validation prompt."""
        return _text_of(self.messages[-1]) if self.messages[-1]["role"] == "assistant" else ""


@stateless
def cook_conversation(sample: dict) -> Conversation:
    """Crude CLEVR-format sample -> `Conversation`; `MalformedSample` names the key and the problem."""
    key = sample.get("__key__", "?")
    record = _read_json(sample, key)
    messages, refs = _messages(record, key)
    decoded: dict[str, MediaItem] = {}
    for ref in refs:
        if ref not in decoded:
            decoded[ref] = _media_item(sample, record, ref, key)
    media = [decoded[ref] for ref in refs]
    return Conversation(
        __key__=key,
        __restore_key__=sample["__restore_key__"],
        __subflavors__=sample.get("__subflavors__"),
        __sources__=sample.get("__sources__"),
        messages=messages,
        media=media,
        annotations={k: v for k, v in record.items() if isinstance(v, str)},
    )


COOK_FUNCTIONS = {"conversation": cook_conversation}


def energon_cookers(names: list[str]) -> list[Cooker]:
    """The Energon `Cooker`s for the recipe's `data.cookers`, in order (first matching subflavor wins)."""
    return [Cooker(cook=COOK_FUNCTIONS[name], has_subflavors=dict(COOKERS[name].subflavors) or None) for name in names]


def media_pixels(conv: Conversation, index: int) -> torch.Tensor:
    """The pixels of image `conv.media[index]` as a uint8 tensor (3, H, W), decoded if still encoded.

    Raises `MalformedSample` naming the sample's key and the media ref when the bytes do not decode.
    """
    item = conv.media[index]
    if isinstance(item.data, torch.Tensor):
        return item.data
    try:
        return decode_image(item.data)
    except Exception as e:  # noqa: BLE001 - every decoder error (OSError, RuntimeError, ...) means the same here
        ref = item.metadata.get("ref", index)
        raise MalformedSample(f"{conv.__key__}: cannot decode {ref!r} ({type(e).__name__}: {e})") from None


def decode_media(conv: Conversation) -> Conversation:
    """Decode every still-encoded image of `conv` in place (for callers that time decoding as a
    stage of its own); returns `conv`."""
    for i, item in enumerate(conv.media):
        if item.modality == "image":
            item.data = media_pixels(conv, i)
    return conv


def decode_image(data: bytes) -> torch.Tensor:
    """Decode image bytes to an RGB uint8 tensor (3, H, W): a channels-first view of one HWC array.

    Raises whatever Pillow raises for truncated or unknown data (`OSError`, `ValueError`, ...).
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        array = np.array(rgb)  # writable (np.asarray would wrap read-only bytes)
    return torch.from_numpy(array).permute(2, 0, 1)


def _read_json(sample: dict, key: str) -> dict:
    raw = sample.get("json")
    if raw is None:
        raise MalformedSample(f"{key}: no .json member (members: {_members(sample)})")
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedSample(f"{key}: .json is not valid JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise MalformedSample(f"{key}: .json has no 'messages' list")
    return record


def _messages(record: dict, key: str) -> tuple[list[dict], list[str]]:
    """Messages with media parts rewritten to indexes, and the member refs in order of appearance."""
    refs: list[str] = []
    messages = []
    for message in record["messages"]:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise MalformedSample(f"{key}: a message without a known role (system, user, assistant)")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise MalformedSample(f"{key}: message content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and isinstance(part.get("ref"), str):
                refs.append(part["ref"])
                parts.append({"type": "image", "media": len(refs) - 1})
            else:
                raise MalformedSample(f"{key}: unsupported content part {str(part)[:80]}")
        messages.append({"role": message["role"], "content": parts})
    if messages[-1]["role"] != "assistant":
        raise MalformedSample(f"{key}: the last message must be the assistant's answer")
    return messages, refs


def _media_item(sample: dict, record: dict, ref: str, key: str) -> MediaItem:
    data = sample.get(ref)
    if not isinstance(data, (bytes, bytearray)):
        raise MalformedSample(f"{key}: media ref {ref!r} names no member (members: {_members(sample)})")
    meta = next((m for m in record.get("media", []) if isinstance(m, dict) and m.get("ref") == ref), {})
    metadata = {k: v for k, v in meta.items() if k != "ref"} | {"ref": ref}
    return MediaItem(modality="image", data=data, metadata=metadata)


def _text_of(message: dict) -> str:
    return "".join(part["text"] for part in message["content"] if part["type"] == "text")


def _members(sample: dict) -> str:
    return ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"
