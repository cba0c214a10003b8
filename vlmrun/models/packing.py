"""The model inputs of a packed batch (data/packing.py): position ids that start again at every sequence.

transformers' Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take packed sequences when they are
given position ids of shape [4, rows, tokens] and no attention mask: the first of the four is the
text position, which builds the causal mask (a position that does not follow the one before starts
a sequence: masking_utils.find_packed_sequence_indices, so each token attends to its own sequence
only; flash-attention finds them the same way, but in a batch of one row only: `runs_as_one_row`),
and the other three are the 3-D mRoPE ids. Those are
computed here for each sequence alone, by the model's own `get_rope_index` over the sequence's
tokens and its images' grid rows (a text-only sequence: its positions on all three axes), so a
packed sequence is rotated exactly as it is alone; a packed rotary table built over the whole row
would carry one sequence's image offsets into the next (the bug AReaL #217, ROLL #452, verl #3653
and LLaMA-Factory #10783 fixed after the fact). The padding at the end of a row is a sequence of its
own, labelled nowhere.

Nemotron-H Omni cannot be packed: transformers' Mamba layers run the scan along the whole row with
no reset at a sequence's start, so each sequence would begin from the previous one's state
(its family's `capabilities.packing` says so, for the recipe check to name: config/families.py).
"""

from __future__ import annotations

import torch

from vlmrun.config.families import FAMILIES


def packing_refusal(family: str) -> str | None:
    """Why `family` cannot be packed, or None."""
    return FAMILIES[family].capabilities.packing


def rope_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `get_rope_index` gives the model's 3-D positions (Qwen's inner model)."""
    owners = [m for m in model.modules() if callable(getattr(type(m), "get_rope_index", None))]
    if not owners:
        raise TypeError(
            f"{type(model).__name__} has no get_rope_index: vlmrun packs the Qwen-VL families only "
            f"({', '.join(f'{f}: {packing_refusal(f)}' for f in FAMILIES if packing_refusal(f) is not None)})"
        )
    return owners[-1]


def sequences_in_rows(attention_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a packed batch, the (start, tokens) of each of its sequences, from the sequence
    numbers its attention mask holds (data/packing.py); padding left out."""
    out = []
    for row in attention_mask.tolist():
        spans: list[tuple[int, int]] = []
        for t, seq in enumerate(row):
            if seq and (not spans or row[t - 1] != seq):
                spans.append((t, 0))
            if seq:
                spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        out.append(spans)
    return out


def packed_position_ids(model: torch.nn.Module, batch) -> torch.Tensor:
    """[4, rows, tokens]: per row, each sequence's text positions and its mRoPE ids as computed for the
    sequence alone, then the padding's own positions (module doc). A sequence's images are the runs of
    image tokens in its `mm_token_type_ids`, taking the batch's grid rows in order."""
    owner = rope_owner(model)
    grids = batch.media.get("image_grid_thw")
    types = batch.token_inputs["mm_token_type_ids"]
    rows, width = batch.input_ids.shape
    out = torch.empty((4, rows, width), dtype=torch.long, device=batch.input_ids.device)
    image = 0
    for r, sequences in enumerate(sequences_in_rows(batch.attention_mask)):
        end = 0
        for at, tokens in sequences:
            ids = batch.input_ids[r : r + 1, at : at + tokens]
            kinds = types[r : r + 1, at : at + tokens]
            text = torch.arange(tokens, device=ids.device)
            out[0, r, at : at + tokens] = text
            images = _runs_of_ones(kinds[0])
            if images:
                if grids is None or image + images > grids.shape[0]:
                    raise ValueError(f"row {r}: a sequence shows {images} image(s) the batch's media do not hold")
                rope, _ = owner.get_rope_index(
                    ids,
                    mm_token_type_ids=kinds,
                    image_grid_thw=grids[image : image + images],
                    attention_mask=torch.ones_like(ids),
                )
                out[1:, r, at : at + tokens] = rope[:, 0]
                image += images
            else:
                out[1:, r, at : at + tokens] = text
            end = at + tokens
        out[:, r, end:] = torch.arange(width - end, device=out.device)  # the padding, a sequence of its own
    if image != (0 if grids is None else grids.shape[0]):
        raise ValueError(f"the packed sequences show {image} images, the batch's media hold {grids.shape[0]}")
    return out


def _runs_of_ones(kinds: torch.Tensor) -> int:
    """How many runs of 1 (image tokens) a sequence's mm_token_type_ids hold: its images."""
    ones = (kinds == 1).to(torch.int8)
    return int((ones[1:] > ones[:-1]).sum()) + int(ones[0]) if ones.numel() else 0


def runs_as_one_row(model: torch.nn.Module) -> bool:
    """Whether `model` attends with a flash-attention kernel, which takes packed sequences as one row.

    transformers finds the sequences of a flash-attention forward from the position ids only when the
    batch is one row (`_is_packed_sequence`: batch size 1), then runs the varlen kernel over them; given
    several rows it would run each row as one causal sequence, every sequence seeing the ones before it
    in its row. So a packed batch goes to such a model as its rows laid end to end (`packed_inputs`):
    the padding at a row's end is a sequence of its own there too, and the tokens keep their order, so
    the logits come back in the rows' row-major order."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def packed_inputs(model: torch.nn.Module, batch, *, one_row: bool | None = None) -> dict[str, torch.Tensor]:
    """The forward's inputs of a packed `batch`: its tokens, per-token inputs and media, the position ids
    of `packed_position_ids` and no attention mask (module doc); its rows laid end to end as one row
    when `one_row` (default: `runs_as_one_row(model)`), which changes no value (positions restart at
    every sequence either way)."""
    positions = packed_position_ids(model, batch)
    inputs = {"input_ids": batch.input_ids, **batch.token_inputs}
    if runs_as_one_row(model) if one_row is None else one_row:
        inputs = {k: v.reshape(1, -1) for k, v in inputs.items()}
        positions = positions.reshape(positions.shape[0], 1, -1)
    return {**inputs, **batch.media, "position_ids": positions}
