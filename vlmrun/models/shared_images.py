"""Each distinct image through the vision tower once per forward, its features read by every row that shows it.

In GRPO a prompt's G responses are G rows that show the same images, in the same micro-batch (the
logprob and train stages lay out a prompt's responses side by side) and in the same `generate` call.
The vision tower's cost grows with the patch rows it is given, so by default each image went through
it G times per stage, every copy giving the same features.

1. `share_images` lays out the media of a batch's rows with each distinct image's pixel rows once
   (in order of first appearance) and the grid of every row's images, as before: the text model's
   3-D positions (Qwen's mRoPE) read the grid per row. It returns `image_source` beside them: for each
   image of the batch, in order, the index of the distinct image it shows (None when none repeats:
   the plain layout, nothing to do).
2. Within `vision_once(model, image_source)`, the model's `get_image_features` (the one method each
   supported family's forward calls with the pixels and the grid: Qwen2-VL, Qwen2.5-VL and Qwen3-VL
   on their inner `model`, Nemotron-H Omni on the top-level model) encodes the distinct images alone
   (the grid rows of their first appearances) and gives the forward per-image features indexed by
   `image_source`: every placeholder is filled as before, from the same tensors. Qwen3-VL's deepstack
   features are indexed the same way. The backward sums the gradient of the rows that read an
   image's features, as G separate passes would have summed it, to float round-off.
3. The wrapper is an attribute of the module instance, set for the context only; the model's class and
   any other call are untouched. Activation checkpointing recomputes decoder layers, never the tower,
   so the backward after the context needs nothing of it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

METHOD = "get_image_features"


def share_images(
    per_row: Sequence[Mapping[str, torch.Tensor]], groups: Sequence[Hashable], *, pixels: str, grid: str
) -> tuple[dict[str, torch.Tensor], tuple[int, ...] | None]:
    """The media of rows whose media are `per_row` ({} for a text-only row, else {pixels: [P, D], grid:
    [k, ...]} for its k images), where rows with equal `groups` keys show the same images: each group's
    pixel rows once, every row's grid; and `image_source` (module doc). Raises ValueError when two
    rows of one group do not hold the same images."""
    first: dict[Hashable, tuple[int, Mapping[str, torch.Tensor]]] = {}
    pixel_parts, grid_parts, source = [], [], []
    distinct = 0
    for media, key in zip(per_row, groups, strict=True):
        if not media:
            continue
        if key not in first:
            first[key] = (distinct, media)
            pixel_parts.append(media[pixels])
            distinct += media[grid].shape[0]
        start, shown = first[key]
        if not all(shown[k] is media[k] or torch.equal(shown[k], media[k]) for k in (grid, pixels)):
            raise ValueError(f"rows of group {key!r} hold different images: they cannot share one vision pass")
        grid_parts.append(media[grid])
        source.extend(range(start, start + media[grid].shape[0]))
    if not grid_parts:
        return {}, None
    media = {pixels: torch.cat(pixel_parts), grid: torch.cat(grid_parts)}
    return media, (tuple(source) if distinct < len(source) else None)


def repeated_images(
    per_row: Sequence[Mapping[str, torch.Tensor]], *, pixels: str, grid: str
) -> dict[str, torch.Tensor]:
    """The plain layout of `per_row` (every row's copy of its images, each through the tower)."""
    shown = [m for m in per_row if m]
    return {k: torch.cat([m[k] for m in shown]) for k in (pixels, grid)} if shown else {}


def feature_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `get_image_features` the model's forward calls: the deepest that defines it
    (the top-level Qwen models delegate to their inner `model`)."""
    owners = [m for m in model.modules() if callable(getattr(type(m), METHOD, None))]
    if not owners:
        raise TypeError(f"{type(model).__name__} has no {METHOD}: it cannot share a vision pass between rows")
    return owners[-1]


@contextmanager
def vision_once(model: torch.nn.Module, image_source: Sequence[int] | None) -> Iterator[None]:
    """Within it, `model`'s forward encodes each distinct image once (module doc); no-op for None."""
    if image_source is None:
        yield
        return
    owner = feature_owner(model)
    if METHOD in vars(owner):
        raise RuntimeError(f"{type(owner).__name__}.{METHOD} is already shared (vision_once does not nest)")
    original = getattr(owner, METHOD)
    source = list(image_source)
    distinct = max(source) + 1
    first_of = {}
    for image, d in enumerate(source):
        first_of.setdefault(d, image)
    if sorted(first_of) != list(range(distinct)):
        raise ValueError(f"image_source {source} skips a distinct image")
    firsts = torch.tensor([first_of[d] for d in range(distinct)], dtype=torch.long)

    signature = inspect.signature(original)
    grid_name = list(signature.parameters)[1]  # (pixels, grid, ...) in every family

    @functools.wraps(original)  # generate reads its signature to pick the arguments it passes by name
    def features(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        grid = bound.arguments[grid_name]
        if grid.shape[0] != len(source):
            raise ValueError(f"the batch's grid describes {grid.shape[0]} images, image_source {len(source)}")
        bound.arguments[grid_name] = grid[firsts.to(grid.device)]
        out = original(*bound.args, **bound.kwargs)
        pooled = getattr(out, "pooler_output", None)
        if not isinstance(pooled, tuple | list) or len(pooled) != distinct:
            raise TypeError(f"{type(owner).__name__}.{METHOD} did not return one feature tensor per image")
        out.pooler_output = tuple(pooled[d] for d in source)
        deep = getattr(out, "deepstack_features", None)
        if deep is not None:
            out.deepstack_features = [tuple(layer[d] for d in source) for layer in deep]
        return out

    setattr(owner, METHOD, features)
    try:
        yield
    finally:
        delattr(owner, METHOD)
