"""Pick rows of a `PromptBatch` (repeat each prompt G times, cut a batch into replica shares) with their media.

A `PromptBatch` packs the media of all its prompts in sample order: `pixel_values` holds the patch rows
of every image, `image_grid_thw` (Qwen) or `image_grid_hw` (Nemotron) one row per image giving its
patch grid. Which images belong to which prompt is not stored; it follows from the placeholder
tokens: every image contributes grid-product patch rows and a fixed fraction of them as placeholder
tokens (1/4 for every tiny family: 2x2 merge or pixel shuffle), so the rows of prompt i are its
placeholder count times the batch's rows-per-token ratio, and its images are the next ones in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmrun.data.batch import PromptBatch
from vlmrun.models.shared_images import share_images

ROWS_KEY = "pixel_values"
GRID_KEYS = ("image_grid_thw", "image_grid_hw")


def select_prompts(batch: PromptBatch, rows: Sequence[int], image_token_id: int | None) -> PromptBatch:
    """The prompts `rows` of `batch` (repeats allowed), in that order, with their media and answers.

    The width (left padding) stays that of `batch`. Raises ValueError for media this module cannot
    split (videos) or media that do not add up with the placeholder tokens.
    """
    index = torch.tensor(list(rows), dtype=torch.long)
    per_prompt = prompt_media(batch, image_token_id)
    chosen = [per_prompt[i] for i in rows if per_prompt[i]]
    media = {k: torch.cat([m[k] for m in chosen]) for k in chosen[0]} if chosen else {}
    return PromptBatch(
        sample_ids=[batch.sample_ids[i] for i in rows],
        input_ids=batch.input_ids[index],
        attention_mask=batch.attention_mask[index],
        answers=[batch.answers[i] for i in rows],
        media=media,
        token_inputs={k: v[index] for k, v in batch.token_inputs.items()},
        templates=[batch.templates[i] for i in rows] if batch.templates else [],
    )


def shared_prompt_media(
    batch: PromptBatch, rows: Sequence[int], image_token_id: int | None
) -> tuple[dict[str, torch.Tensor], tuple[int, ...] | None]:
    """The media of `select_prompts(batch, rows)` for one forward that encodes each prompt's images
    once, however often `rows` repeats it, and their `image_source` (models/shared_images.py)."""
    if not batch.media:
        return {}, None
    per_prompt = prompt_media(batch, image_token_id)
    return share_images([per_prompt[i] for i in rows], list(rows), pixels=ROWS_KEY, grid=_grid_key(batch.media))


def join_prompts(batches: Sequence[PromptBatch], pad_token_id: int) -> PromptBatch:
    """The prompts of `batches` in order as one batch, left-padded with `pad_token_id` to the widest."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.input_ids.shape[1] for b in batches)

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    with_media = [b.media for b in batches if b.media]
    return PromptBatch(
        sample_ids=[i for b in batches for i in b.sample_ids],
        input_ids=torch.cat([left(b.input_ids, pad_token_id) for b in batches]),
        attention_mask=torch.cat([left(b.attention_mask, 0) for b in batches]),
        answers=[a for b in batches for a in b.answers],
        media={k: torch.cat([m[k] for m in with_media]) for k in with_media[0]} if with_media else {},
        token_inputs={k: torch.cat([left(b.token_inputs[k], 0) for b in batches]) for k in batches[0].token_inputs},
        templates=[t for b in batches for t in b.templates] if all(b.templates for b in batches) else [],
    )


def prompt_media(batch: PromptBatch, image_token_id: int | None) -> list[dict[str, torch.Tensor]]:
    """The media of every prompt of `batch` ({} for a text-only prompt), in sample order."""
    if not batch.media:
        return [{} for _ in range(len(batch))]
    grid_key = _grid_key(batch.media)
    pixels, grids = batch.media[ROWS_KEY], batch.media[grid_key]
    if image_token_id is None:
        raise ValueError("the prompts carry images but the model has no image_token_id")
    tokens = ((batch.input_ids == image_token_id) & batch.attention_mask.bool()).sum(dim=1).tolist()
    image_rows = grids.prod(dim=-1).tolist()
    if sum(tokens) == 0 or pixels.shape[0] % sum(tokens) or sum(image_rows) != pixels.shape[0]:
        raise ValueError(
            f"{pixels.shape[0]} {ROWS_KEY} rows in {len(image_rows)} images do not match "
            f"{sum(tokens)} placeholder tokens (id {image_token_id})"
        )
    ratio = pixels.shape[0] // sum(tokens)
    out, image, row = [], 0, 0
    for i, n_tokens in enumerate(tokens):
        want, start_image, start_row = n_tokens * ratio, image, row
        while row - start_row < want:
            row += image_rows[image]
            image += 1
        if row - start_row != want:
            raise ValueError(f"prompt {batch.sample_ids[i]}: its images do not end where its placeholders do")
        out.append({ROWS_KEY: pixels[start_row:row], grid_key: grids[start_image:image]} if want else {})
    return out


def _grid_key(media: dict[str, torch.Tensor]) -> str:
    grid = [k for k in GRID_KEYS if k in media]
    unknown = set(media) - {ROWS_KEY, *GRID_KEYS}
    if len(grid) != 1 or ROWS_KEY not in media or unknown:
        raise ValueError(
            f"prompt media {sorted(media)}: generation splits images only ({ROWS_KEY} and one of {GRID_KEYS})"
        )
    return grid[0]
