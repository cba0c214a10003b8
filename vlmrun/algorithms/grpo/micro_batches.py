"""Per-sample GRPO columns (as the plane returns them) -> the micro-batches the policy runs, and back.

1. A sample is one response: its prompt (`prompt_ids`, unpadded), its response (`response_ids`, up
   to and including the end-of-turn token), the prompt's per-token inputs and its packed media.
2. `model_batches` lays out `rows` samples per micro-batch, each a sequence of its prompt then its
   response, labels on the response tokens: one right-padded row per sample, or with `pack_tokens`
   (the recipe's `data.pack_tokens`) the sequences end to end in rows of at most that many tokens, in
   order (data/packing.py: the attention mask holds each token's sequence number in its row, the
   policy gives every sequence its own positions and attention). Media in sample order, cast to the
   policy's dtype, each prompt's images once however many of its responses the micro-batch holds,
   with `image_source` saying which images they are (models/shared_images.py: the policy encodes
   each image once and every response reads its features). The logprob stages and the train stage
   call it on the same samples in the same order, so the policy sees identical inputs: with one inner
   step the ratio is exactly 1.
3. Per-token values of a response (logprobs, advantages) sit in a [rows, T-1] tensor of next-token
   scores at positions [start + len(prompt) - 1, start + len(prompt) - 1 + L) of the sample's row,
   where `start` is where its sequence begins (`sequence_starts`): `response_values` reads them out
   per sample, `place_response_values` puts them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrun.config.families import family_spec
from vlmrun.data.batch import IGNORE_INDEX, Batch
from vlmrun.data.packing import rows_in_order, rows_of_count
from vlmrun.models.shared_images import repeated_images
from vlmrun.models.shared_images import share_images as shared_image_media
from vlmrun.plane.interface import SampleBatch


@dataclass
class PgMicroBatch:
    """A train micro-batch: the model inputs and, per next-token position [B, T-1], the logprobs the
    loss compares and each response's advantage (0 off the responses)."""

    batch: Batch
    advantages: torch.Tensor
    prev_logprobs: torch.Tensor
    generation_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return self.batch.model_inputs()

    # A packed micro-batch's inputs are built from its fields (models/packing.py: packed_inputs)
    @property
    def is_packed(self) -> bool:
        return self.batch.is_packed

    @property
    def input_ids(self) -> torch.Tensor:
        return self.batch.input_ids

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.batch.attention_mask

    @property
    def token_inputs(self) -> dict[str, torch.Tensor]:
        return self.batch.token_inputs

    @property
    def media(self) -> dict[str, torch.Tensor]:
        return self.batch.media

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
    pack_tokens: int | None = None,
    groups: Sequence[range] | None = None,
) -> list[Batch]:
    """`got`'s samples, `rows` per micro-batch (or the consecutive `groups` of them, `token_groups`), in
    order, padded or packed into rows of `pack_tokens` (module doc). Uses `response_mask` for the
    labels where `got` holds it (the train stage), else labels every response token."""
    spec = family_spec(family)
    return [
        _one_batch(got, idx, spec, pad_token_id, pixel_dtype, share_images, pack_tokens)
        for idx in (groups or sample_groups(len(got), rows))
    ]


def sample_groups(samples: int, rows: int) -> list[range]:
    """Consecutive groups of `rows` samples (the last may hold fewer)."""
    return [range(start, min(start + rows, samples)) for start in range(0, samples, rows)]


def sequence_lengths(got: SampleBatch) -> list[int]:
    """Each sample's sequence: its prompt and its response, in tokens."""
    return [p.numel() + r.numel() for p, r in zip(got["prompt_ids"], got["response_ids"], strict=True)]


def token_groups(got: SampleBatch, row_tokens: int, count: int) -> list[range]:
    """`count` consecutive groups of `got`'s samples, each one row of at most `row_tokens` tokens
    (`data.pack_by: tokens`; data/packing.rows_of_count)."""
    return [range(row[0], row[-1] + 1) for row in rows_of_count(sequence_lengths(got), row_tokens, count)]


def _one_batch(
    got: SampleBatch, idx: range, spec, pad_token_id: int, pixel_dtype, share_images: bool, pack_tokens: int | None
) -> Batch:
    prompts = [got["prompt_ids"][i] for i in idx]
    responses = [got["response_ids"][i] for i in idx]
    masks = [got["response_mask"][i] for i in idx] if "response_mask" in got.columns else None
    lengths = [p.numel() + r.numel() for p, r in zip(prompts, responses, strict=True)]
    if pack_tokens is None:
        layout = [[k] for k in range(len(idx))]
    else:
        layout = rows_in_order(lengths, pack_tokens)  # raises for a sequence longer than a row
    width = max(sum(lengths[k] for k in row) for row in layout)
    input_ids = torch.full((len(layout), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(layout), width), dtype=torch.long)
    labels = torch.full((len(layout), width), IGNORE_INDEX, dtype=torch.long)
    tokens = {k: torch.zeros((len(layout), width), dtype=torch.long) for k in spec.token_keys}
    for row, members in enumerate(layout):
        at = 0
        for j, k in enumerate(members):  # the row's j-th sequence is sample k: its sequence number is j + 1
            p, r = prompts[k], responses[k]
            a, n = at + p.numel(), at + lengths[k]
            input_ids[row, at:a], input_ids[row, a:n], attention[row, at:n] = p, r, j + 1
            labels[row, a:n] = r if masks is None else r.masked_fill(~masks[k].bool(), IGNORE_INDEX)
            for key, t in tokens.items():
                t[row, at:a] = got[key][idx[k]]
            at = n
    pixels, grid = spec.media_keys
    per_row = [{k: _one(got[k][i]) for k in (pixels, grid)} if got[pixels][i] else {} for i in idx]
    if share_images:  # a prompt's responses show its images: each through the tower once (module doc)
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


def sequence_starts(batch: Batch) -> list[tuple[int, int]]:
    """(row, column) where each sample's sequence begins, in sample order (module doc): a token whose
    sequence number differs from the one before it (data/packing.py's attention mask)."""
    seq = batch.attention_mask
    before = torch.nn.functional.pad(seq, (1, 0))[:, :-1]
    return [tuple(x) for x in ((seq > 0) & (seq != before)).nonzero().tolist()]


def response_values(
    scores: torch.Tensor,
    starts: Sequence[tuple[int, int]],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
) -> list:
    """Per sample, its response's values out of next-token `scores` [rows, T-1] (module doc)."""
    return [
        scores[row, at + a - 1 : at + a - 1 + n].clone()
        for (row, at), a, n in zip(starts, prompt_lengths, response_lengths, strict=True)
    ]


def batch_response_values(scores: torch.Tensor, batch: Batch, got: SampleBatch, first: int) -> list:
    """`response_values` of micro-batch `batch`, which holds `got`'s samples from `first` on."""
    idx = range(first, first + len(batch))
    a = [got["prompt_ids"][i].numel() for i in idx]
    n = [got["response_ids"][i].numel() for i in idx]
    return response_values(scores, sequence_starts(batch), a, n)


def place_response_values(
    values: Sequence[torch.Tensor],
    starts: Sequence[tuple[int, int]],
    prompt_lengths: Sequence[int],
    shape: tuple[int, int],
) -> torch.Tensor:
    """The inverse of `response_values`: float32 of `shape` ([rows, T] of the micro-batch), less its
    last column, 0 off the responses."""
    out = torch.zeros((shape[0], shape[1] - 1), dtype=torch.float32)
    for v, (row, at), a in zip(values, starts, prompt_lengths, strict=True):
        out[row, at + a - 1 : at + a - 1 + v.numel()] = v
    return out


def pg_micro_batches(got: SampleBatch, rows: int, **layout) -> list[PgMicroBatch]:
    """The train stage's micro-batches: `model_batches` plus advantages and the logprobs the loss reads."""
    out = []
    groups = layout.get("groups") or sample_groups(len(got), rows)
    for idx, batch in zip(groups, model_batches(got, rows, **layout), strict=True):
        a = [got["prompt_ids"][i].numel() for i in idx]
        starts, shape = sequence_starts(batch), tuple(batch.input_ids.shape)

        def placed(name: str, a=a, idx=idx, starts=starts, shape=shape) -> torch.Tensor:
            return place_response_values([got[name][i] for i in idx], starts, a, shape)

        each = [got["advantages"][i].float().expand(got["response_ids"][i].numel()) for i in idx]
        out.append(
            PgMicroBatch(
                batch=batch,
                advantages=place_response_values(each, starts, a, shape),
                prev_logprobs=placed("prev_logprobs"),
                generation_logprobs=placed("generation_logprobs"),
                ref_logprobs=placed("ref_logprobs") if "ref_logprobs" in got.columns else None,
            )
        )
    return out
