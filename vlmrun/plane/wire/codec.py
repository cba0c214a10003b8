"""One field's per-sample values <-> flat 1-D rows plus the tags that restore them.

What a caller puts, per sample, by the field's alignment (fields.py):

    SAMPLE           a tensor with the field's `ndim` dimensions (a reward is 0-d)
    PROMPT_TOKEN     a 1-D tensor, one entry per token
    RESPONSE_TOKEN
    MEDIA            a list of segments (tensors of any shape; [] for a text-only sample)

Each value becomes the flat 1-D pieces of one row (views where the value is contiguous: one piece,
or one per media segment; the row is their concatenation, made once, by whoever packs the rows) and a
tag `{"dtype": name, "shape": [...]}` or, for media, `{"dtype": name, "segments": [[...], ...]}`.
Nothing is padded. Decoding needs the tag: a media row without its segment shapes raises, as does a
row whose length disagrees with its tag, a value of a type the wire does not know, or a dtype other
than the registry's. Pixel values (dtype "policy") are cast to `pixel_dtype` before they become rows;
every other field must already have its registry dtype; one field of one put has one dtype. Decoded
values are views of the rows: the caller owns them and may keep them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from vlmrun.plane.fields import POLICY_DTYPE, Alignment, FieldSpec
from vlmrun.plane.interface import DataPlaneError

#: Per sample and field: {"dtype": "float32", "shape": [...]} or, for media, {"dtype": ..., "segments": [[...], ...]}.
FieldTag = dict[str, Any]
#: One sample's row as flat 1-D pieces in order (their concatenation is the row).
Pieces = list[torch.Tensor]


class WireError(DataPlaneError):
    """A value the wire cannot carry exactly (an unknown type, a wrong dtype, a media row without shapes)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"{name!r} is not a torch dtype")
    return dtype


def encode_column(
    spec: FieldSpec, values: Sequence[Any], *, pixel_dtype: torch.dtype | None = None
) -> tuple[list[Pieces], list[FieldTag]]:
    """Each sample's row pieces and tag for field `spec`; `WireError` on anything it cannot carry."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise WireError(f"{spec.name}: give one value per sample as a list, not {type(values).__name__}")
    pieces, tags = [], []
    for i, value in enumerate(values):
        if spec.alignment is Alignment.MEDIA:
            p, tag = _encode_media(spec, i, value, pixel_dtype)
        else:
            p, tag = _encode_tensor(spec, i, value)
        pieces.append(p)
        tags.append(tag)
    dtypes = {t["dtype"] for p, t in zip(pieces, tags, strict=True) if p}
    if len(dtypes) > 1:
        raise WireError(f"{spec.name}: one put of a field has one dtype, got {sorted(dtypes)} (set pixel_dtype)")
    for p, t in zip(pieces, tags, strict=True):
        if not p and dtypes:
            t["dtype"] = next(iter(dtypes))  # a sample without segments takes the column's dtype
    return pieces, tags


def join(pieces: Pieces, tag: FieldTag) -> torch.Tensor:
    """A sample's row from its pieces: a view for one piece, one copy for several, empty for none."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else empty_row(tag)


def decode_column(spec: FieldSpec, rows: Sequence[torch.Tensor], tags: Sequence[FieldTag | None]) -> list[Any]:
    """The values `encode_column` was given, rebuilt from `rows` and their tags."""
    if len(rows) != len(tags):
        raise WireError(f"{spec.name}: {len(rows)} rows but {len(tags)} tags")
    return [_decode_one(spec, i, row, tag) for i, (row, tag) in enumerate(zip(rows, tags, strict=True))]


def row_numel(tag: FieldTag) -> int:
    """The length of the row that `tag` describes."""
    if "segments" in tag:
        return sum(math.prod(s) for s in tag["segments"])
    return math.prod(tag["shape"])


def empty_row(tag: FieldTag) -> torch.Tensor:
    """The row of a value with no elements (a text-only sample's media, an empty response)."""
    return torch.empty(0, dtype=dtype_of(tag["dtype"]))


def pack_media(values: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """The packed tensor a model takes: every sample's segments concatenated along dim 0 in order
    (None when no sample has any). Segments must agree in their trailing dimensions."""
    segments = [s for sample in values for s in sample]
    return torch.cat(segments, dim=0) if segments else None


def _encode_tensor(spec: FieldSpec, i: int, value: Any) -> tuple[Pieces, FieldTag]:
    _check_tensor(spec, i, value)
    if spec.alignment is not Alignment.SAMPLE and value.dim() != 1:
        raise WireError(f"{spec.name}[{i}]: a per-token field is 1-D, got shape {tuple(value.shape)}")
    if spec.ndim is not None and value.dim() != spec.ndim:
        raise WireError(f"{spec.name}[{i}]: expected {spec.ndim} dimensions, got shape {tuple(value.shape)}")
    _check_dtype(spec, i, value.dtype)
    return [value.reshape(-1)], {"dtype": dtype_name(value.dtype), "shape": list(value.shape)}


def _encode_media(spec: FieldSpec, i: int, value: Any, pixel_dtype: torch.dtype | None) -> tuple[Pieces, FieldTag]:
    if not isinstance(value, list | tuple):
        raise WireError(
            f"{spec.name}[{i}]: a media field takes a list of segments per sample (got {type(value).__name__}); "
            "put [tensor] for one segment, [] for none"
        )
    segments = []
    for seg in value:
        _check_tensor(spec, i, seg)
        if seg.dim() == 0:
            raise WireError(f"{spec.name}[{i}]: a media segment has at least one dimension")
        segments.append(_media_dtype(spec, i, seg, pixel_dtype))
    dtypes = {s.dtype for s in segments}
    if len(dtypes) > 1:
        raise WireError(f"{spec.name}[{i}]: segments of one sample must share a dtype, got {sorted(map(str, dtypes))}")
    dtype = segments[0].dtype if segments else _default_media_dtype(spec, pixel_dtype)
    flat = [s.reshape(-1) for s in segments]
    return flat, {"dtype": dtype_name(dtype), "segments": [list(s.shape) for s in segments]}


def _media_dtype(spec: FieldSpec, i: int, seg: torch.Tensor, pixel_dtype: torch.dtype | None) -> torch.Tensor:
    if spec.dtype != POLICY_DTYPE:
        _check_dtype(spec, i, seg.dtype)
        return seg
    if not seg.is_floating_point():
        raise WireError(f"{spec.name}[{i}]: pixel values are floating point, got {seg.dtype}")
    return seg if pixel_dtype is None else seg.to(pixel_dtype)


def _default_media_dtype(spec: FieldSpec, pixel_dtype: torch.dtype | None) -> torch.dtype:
    if spec.dtype == POLICY_DTYPE:
        return pixel_dtype or torch.float32
    return dtype_of(spec.dtype)


def _check_tensor(spec: FieldSpec, i: int, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise WireError(f"{spec.name}[{i}]: the wire carries torch tensors, got {type(value).__name__}")
    if value.is_nested or value.layout is not torch.strided:
        raise WireError(f"{spec.name}[{i}]: give a plain (strided) tensor, got layout {value.layout}")
    if value.device.type != "cpu":
        raise WireError(f"{spec.name}[{i}]: the wire carries CPU tensors, got one on {value.device}")


def _check_dtype(spec: FieldSpec, i: int, dtype: torch.dtype) -> None:
    if dtype_name(dtype) != spec.dtype:
        raise WireError(f"{spec.name}[{i}]: dtype {dtype_name(dtype)}, the registry says {spec.dtype}")


def _decode_one(spec: FieldSpec, i: int, row: torch.Tensor, tag: FieldTag | None) -> Any:
    if spec.alignment is Alignment.MEDIA:
        if not tag or "segments" not in tag:
            raise WireError(f"{spec.name}[{i}]: a media row arrived without its segment shapes")
    elif not tag or "shape" not in tag:
        raise WireError(f"{spec.name}[{i}]: a row arrived without its shape")
    if row.dim() != 1 or row.numel() != row_numel(tag):
        raise WireError(
            f"{spec.name}[{i}]: row of shape {tuple(row.shape)}, its tag says {row_numel(tag)} elements ({tag})"
        )
    if dtype_name(row.dtype) != tag["dtype"]:
        raise WireError(f"{spec.name}[{i}]: row dtype {dtype_name(row.dtype)}, its tag says {tag['dtype']}")
    if spec.alignment is not Alignment.MEDIA:
        return row.reshape(tag["shape"])
    shapes = tag["segments"]
    pieces = row.split([math.prod(s) for s in shapes]) if shapes else ()
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]
