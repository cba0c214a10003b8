"""Per-sample GRPO columns (as the plane returns them) -> the micro-batches the policy runs, and back.

1. A sample is one response: its prompt (`prompt_ids`, unpadded), its response (`response_ids`, up
   to and including the end-of-turn token), the prompt's per-token inputs and its packed media.
2. `model_batches` lays out `rows` samples per micro-batch, prompt then response, right-padded to the
   micro-batch's longest, labels on the response tokens; media in sample order, cast to the policy's
   dtype, each prompt's images once however many of its responses the micro-batch holds, with
   `image_source` saying which rows show them (models/shared_images.py: the policy encodes each image
   once and every response reads its features). The logprob stages and the train stage call it on
   the same samples in the same order, so the policy sees identical inputs: with one inner step the
   ratio is exactly 1.
3. Per-token values of a response (logprobs) sit at positions [len(prompt) - 1, len(prompt) - 1 + L)
   of a [B, T-1] tensor of next-token scores: `response_values` reads them out per sample,
   `place_response_values` puts them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrun.config.families import family_spec
from vlmrun.data.batch import IGNORE_INDEX, Batch
from vlmrun.models.shared_images import repeated_images
from vlmrun.models.shared_images import share_images as shared_image_media
from vlmrun.plane.interface import SampleBatch


@dataclass
class PgMicroBatch:
    """A train micro-batch: the model inputs and, per next-token position [B, T-1], the logprobs the
    loss compares (0 off the response); `advantages` [B] one per response."""

    batch: Batch
    advantages: torch.Tensor
    prev_logprobs: torch.Tensor
    generation_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return self.batch.model_inputs()

    @property
    def labels(self) -> torch.Tensor:
        """[B, T] the response tokens' ids, IGNORE_INDEX elsewhere: the positions the policy scores."""
        return self.batch.labels

    @property
    def image_source(self) -> tuple[int, ...] | None:
        return self.batch.image_source

    @property
    def mask(self) -> torch.Tensor:
        """[B, T-1] bool: the positions whose next token is a response token that counts in the loss."""
        return self.batch.labels[:, 1:] != IGNORE_INDEX


def model_batches(
    got: SampleBatch,
    rows: int,
    *,
    family: str,
    pad_token_id: int,
    pixel_dtype: torch.dtype | None,
    share_images: bool = True,
) -> list[Batch]:
    """`got`'s samples, `rows` per micro-batch, in order (module doc, 2). Uses `response_mask` for the
    labels where `got` holds it (the train stage), else labels every response token."""
    spec = family_spec(family)
    return [
        _one_batch(got, range(start, min(start + rows, len(got))), spec, pad_token_id, pixel_dtype, share_images)
        for start in range(0, len(got), rows)
    ]


def _one_batch(got: SampleBatch, idx: range, spec, pad_token_id: int, pixel_dtype, share_images: bool) -> Batch:
    prompts = [got["prompt_ids"][i] for i in idx]
    responses = [got["response_ids"][i] for i in idx]
    masks = [got["response_mask"][i] for i in idx] if "response_mask" in got.columns else None
    width = max(p.numel() + r.numel() for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(idx), width), dtype=torch.long)
    labels = torch.full((len(idx), width), IGNORE_INDEX, dtype=torch.long)
    tokens = {k: torch.zeros((len(idx), width), dtype=torch.long) for k in spec.token_keys}
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        a, n = p.numel(), p.numel() + r.numel()
        input_ids[row, :a], input_ids[row, a:n], attention[row, :n] = p, r, 1
        labels[row, a:n] = r if masks is None else r.masked_fill(~masks[row].bool(), IGNORE_INDEX)
        for k, t in tokens.items():
            t[row, :a] = got[k][idx[row]]
    pixels, grid = spec.media_keys
    per_row = [{k: _one(got[k][i]) for k in (pixels, grid)} if got[pixels][i] else {} for i in idx]
    if share_images:  # a prompt's responses show its images: each through the tower once (module doc, 2)
        groups = [_prompt_of(got.sample_ids[i]) for i in idx]
        media, source = shared_image_media(per_row, groups, pixels=pixels, grid=grid)
    else:
        media, source = repeated_images(per_row, pixels=pixels, grid=grid), None
    if pixel_dtype is not None and "pixel_values" in media:
        media["pixel_values"] = media["pixel_values"].to(pixel_dtype)
    return Batch(
        sample_ids=[got.sample_ids[i] for i in idx],
        input_ids=input_ids,
        attention_mask=attention,
        labels=labels,
        media=media,
        token_inputs=tokens,
        image_source=source,
    )


def _one(segments: list[torch.Tensor]) -> torch.Tensor:
    """A sample's media field from its segments: the tensor itself when there is one (the rows of a
    prompt then share it, and `share_images` sees that without comparing them)."""
    return segments[0] if len(segments) == 1 else torch.cat(segments)


def _prompt_of(sample_id: str) -> str:
    """A response's prompt id (`<prompt id>#<g>`, rollout_rows.py); a sample that is no response is its own."""
    prompt, sep, _ = sample_id.rpartition("#")
    return prompt if sep else sample_id


def response_values(scores: torch.Tensor, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> list:
    """Per sample, its response's values out of next-token `scores` [B, T-1] (module doc, 3)."""
    return [
        scores[row, a - 1 : a - 1 + n].clone()
        for row, (a, n) in enumerate(zip(prompt_lengths, response_lengths, strict=True))
    ]


def place_response_values(values: Sequence[torch.Tensor], prompt_lengths: Sequence[int], width: int) -> torch.Tensor:
    """The inverse of `response_values`: [B, width - 1] float32, 0 off the responses."""
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for row, (v, a) in enumerate(zip(values, prompt_lengths, strict=True)):
        out[row, a - 1 : a - 1 + v.numel()] = v
    return out


def pg_micro_batches(got: SampleBatch, rows: int, **layout) -> list[PgMicroBatch]:
    """The train stage's micro-batches: `model_batches` plus advantages and the logprobs the loss reads."""
    out = []
    for start, batch in zip(range(0, len(got), rows), model_batches(got, rows, **layout), strict=True):
        idx = range(start, start + len(batch))
        a = [got["prompt_ids"][i].numel() for i in idx]
        width = batch.input_ids.shape[1]

        def placed(name: str, a=a, idx=idx, width=width) -> torch.Tensor:
            return place_response_values([got[name][i] for i in idx], a, width)

        out.append(
            PgMicroBatch(
                batch=batch,
                advantages=torch.stack([got["advantages"][i] for i in idx]).float(),
                prev_logprobs=placed("prev_logprobs"),
                generation_logprobs=placed("generation_logprobs"),
                ref_logprobs=placed("ref_logprobs") if "ref_logprobs" in got.columns else None,
            )
        )
    return out
