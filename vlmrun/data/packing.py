"""Encoded conversations packed end to end into rows of a token budget, instead of one padded row each.

A CLEVR conversation is ~300 tokens and conversations differ in length, so a padded micro-batch
spends part of every forward on padding, and a few rows make a small forward for a GPU. `pack`
lays the sequences one after the other into rows of at most `row_tokens` tokens, in order (a
sequence starts a new row when the current one has no room for it), right-padded to the fullest
row: the sequences, their media and the batch's sample ids keep the order of the samples. Each sequence keeps its own tokens, labels and per-token inputs; the label of a
sequence's first token is IGNORE_INDEX (nothing before it in the row predicts it); media are
concatenated in sample order, which is the order the model's placeholders are filled in. A
micro-batch is still `train.micro_batch_size` samples (`data.pack_tokens` changes how they are
laid out, not which ones are trained on together), so the loader's state, the data order and each
rank's micro-batch count are what they are padded.

The boundaries travel in the batch's attention mask, which holds each token's sequence number
within its row (1, 2, ...; 0 for padding) instead of 1, so every path that carries a micro-batch
(the loader's shared memory, the plane, the driver) carries them too, and a packed batch cannot be
mistaken for a padded one (`Batch.is_packed`); a row of one sequence is a padded row. The model
keeps them: the policy gives it position ids that start again at every sequence
(Qwen's 3-D mRoPE ids computed per sequence, models/packing.py) and no attention mask, from which
transformers builds the block-diagonal causal mask (each token sees its own sequence's earlier
tokens only). A family whose layers carry state along the row (Nemotron's Mamba) cannot be packed:
models/packing.py says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrun.config.families import FamilySpec
from vlmrun.data.batch import IGNORE_INDEX, Batch, media_into, media_layout


def rows_in_order(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """The indices of `lengths` per row, in order, each row holding at most `row_tokens` tokens."""
    rows: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if n > row_tokens:
            raise ValueError(f"a sequence of {n} tokens does not fit a packed row of {row_tokens}")
        if not rows or n > room:
            rows.append([])
            room = row_tokens
        rows[-1].append(i)
        room -= n
    return rows


def packed_layout(samples: Sequence, row_tokens: int, family: FamilySpec) -> dict:
    """Shape and dtype of every tensor `pack` makes of `samples` (chat_encoding's `Encoded`), by field name (as
    `ConversationEncoder.batch_layout`)."""
    rows = rows_in_order([s.input_ids.numel() for s in samples], row_tokens)
    shape = (len(rows), max(sum(samples[i].input_ids.numel() for i in row) for row in rows))
    layout = {name: (shape, torch.long) for name in ("input_ids", "attention_mask", "labels")}
    layout |= {f"token_inputs.{k}": (shape, torch.long) for k in family.token_keys}
    return layout | media_layout(samples)


def pack(
    samples: Sequence,
    *,
    row_tokens: int,
    pad_token_id: int,
    family: FamilySpec,
    out: dict[str, torch.Tensor] | None = None,
) -> Batch:
    """`samples` packed into rows of at most `row_tokens` tokens (module doc). `out` may hold
    preallocated tensors for every field of `packed_layout` (views into a loader worker's shared
    block); they are overwritten and become the batch's tensors."""
    if not samples:
        raise ValueError("pack needs at least one sample")
    if out is None:
        layout = packed_layout(samples, row_tokens, family).items()
        out = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in layout}
    input_ids, labels, attention = out["input_ids"], out["labels"], out["attention_mask"]
    tokens = {k: out[f"token_inputs.{k}"] for k in family.token_keys}
    input_ids.fill_(pad_token_id)
    labels.fill_(IGNORE_INDEX)
    attention.zero_()
    for t in tokens.values():
        t.zero_()
    i = 0
    for r, row in enumerate(rows_in_order([s.input_ids.numel() for s in samples], row_tokens)):
        at = 0
        for j, _ in enumerate(row):
            s = samples[i]
            n = s.input_ids.numel()
            input_ids[r, at : at + n], labels[r, at : at + n], attention[r, at : at + n] = s.input_ids, s.labels, j + 1
            labels[r, at] = IGNORE_INDEX  # predicted by nothing of its own sequence
            for k, t in tokens.items():
                t[r, at : at + n] = s.token_inputs[k]
            at += n
            i += 1
    media = media_into(samples, out)
    return Batch(
        sample_ids=[s.key for s in samples],
        input_ids=input_ids,
        attention_mask=attention,
        labels=labels,
        media=media,
        token_inputs=tokens,
    )


def padding_fraction(batch: Batch) -> float:
    """The share of a batch's token slots that hold padding."""
    return 1.0 - float((batch.attention_mask > 0).sum()) / batch.attention_mask.numel()


@dataclass(frozen=True)
class PackedSequence:
    """One sequence of a packed batch, in the fields `pack` reads of an encoded sample."""

    key: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    token_inputs: dict[str, torch.Tensor]
    media: dict[str, torch.Tensor]


def unpack(batch: Batch, family: FamilySpec) -> list[PackedSequence]:
    """The sequences of packed `batch` in order, each with its tokens, labels (its first one IGNORE_INDEX,
    as `pack` left it), per-token inputs and media: packing them again gives them back. A sequence's
    images are the runs of image tokens in its per-token image marks (`family.token_keys`' first), each
    taking the next grid row and that many pixel rows."""
    pixels, grid = family.media_keys
    grids = batch.media.get(grid)
    marks = batch.token_inputs.get(family.token_keys[0]) if family.token_keys else None
    out: list[PackedSequence] = []
    image = row_of_pixels = 0
    for r in range(batch.input_ids.shape[0]):
        numbers = batch.attention_mask[r]
        for seq in range(1, int(numbers.max()) + 1):
            where = (numbers == seq).nonzero().flatten()
            a, b = int(where[0]), int(where[-1]) + 1
            media: dict[str, torch.Tensor] = {}
            shown = _image_runs(marks[r, a:b]) if marks is not None else 0
            if shown:
                rows = int(grids[image : image + shown].prod(dim=-1).sum())
                media = {
                    pixels: batch.media[pixels][row_of_pixels : row_of_pixels + rows],
                    grid: grids[image : image + shown],
                }
                image, row_of_pixels = image + shown, row_of_pixels + rows
            out.append(
                PackedSequence(
                    key=batch.sample_ids[len(out)],
                    input_ids=batch.input_ids[r, a:b],
                    labels=batch.labels[r, a:b],
                    token_inputs={k: v[r, a:b] for k, v in batch.token_inputs.items()},
                    media=media,
                )
            )
    if len(out) != len(batch.sample_ids) or (grids is not None and image != grids.shape[0]):
        raise ValueError(f"a packed batch of {len(batch.sample_ids)} samples held {len(out)} sequences")
    return out


def _image_runs(marks: torch.Tensor) -> int:
    """Runs of 1 in a sequence's image marks: its images."""
    ones = (marks == 1).long()
    return int((ones.diff() == 1).sum()) + int(ones[0]) if ones.numel() else 0


def rows_for(batches: Sequence[Batch], row_tokens: int) -> int:
    """How many rows of at most `row_tokens` tokens the sequences of packed `batches` fill, in order."""
    lengths = [int(n) for b in batches for n in _lengths(b)]
    return len(rows_in_order(lengths, row_tokens))


def _lengths(batch: Batch) -> list[int]:
    return [
        int((batch.attention_mask[r] == s).sum())
        for r in range(batch.attention_mask.shape[0])
        for s in range(1, int(batch.attention_mask[r].max()) + 1)
    ]


def rows_of_count(lengths: Sequence[int], row_tokens: int, count: int) -> list[list[int]]:
    """`count` rows of the sequences of `lengths`, in order, each of at most `row_tokens` tokens: the
    rows `rows_in_order` fills, then, while there are fewer than `count`, the row with the most tokens
    split at the sequence boundary nearest its middle. ValueError when `count` is below the rows they
    fill or above the sequences."""
    rows = rows_in_order(lengths, row_tokens)
    if not len(rows) <= count <= len(lengths):
        raise ValueError(f"{len(lengths)} sequences fill {len(rows)} rows of {row_tokens} tokens, not {count}")
    while len(rows) < count:
        i = max((k for k, row in enumerate(rows) if len(row) > 1), key=lambda k: sum(lengths[j] for j in rows[k]))
        row, half = rows[i], sum(lengths[j] for j in rows[i]) / 2
        cuts = [sum(lengths[j] for j in row[:c]) for c in range(1, len(row))]
        c = 1 + min(range(len(cuts)), key=lambda k: abs(cuts[k] - half))
        rows[i : i + 1] = [row[:c], row[c:]]
    return rows


def by_tokens(
    batches: Sequence[Batch], *, row_tokens: int, count: int, pad_token_id: int, family: FamilySpec
) -> list[Batch]:
    """The sequences of packed `batches` (a rank's micro-batches of one step) laid out again as `count`
    micro-batches of one row of at most `row_tokens` tokens each, in order (`data.pack_by: tokens`;
    `rows_of_count`: every rank of a step takes the same number of micro-batches, the most any of them
    fills)."""
    sequences = [s for b in batches for s in unpack(b, family)]
    rows = rows_of_count([s.input_ids.numel() for s in sequences], row_tokens, count)
    return [
        pack([sequences[j] for j in row], row_tokens=row_tokens, pad_token_id=pad_token_id, family=family)
        for row in rows
    ]
