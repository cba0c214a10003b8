"""The batch that the task encoder produces and the policy consumes.

Importing this module loads no torch (`SampleCounts` travels to the SFT controller, which holds none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The label of a position that carries no loss (prompt, padding, image tokens); torch's default ignore_index.
IGNORE_INDEX = -100


@dataclass
class Batch:
    """A micro-batch of encoded conversations, right-padded.

    `labels` are -100 outside assistant tokens (prompt, padding); `media` holds
    the processor's packed media tensors (e.g. `pixel_values` rows of all images and
    `image_grid_thw`), concatenated in sample order, or is empty for a text-only batch.
    `token_inputs` holds the processor's other per-token inputs, padded like `input_ids` (e.g.
    Qwen2.5-VL's `mm_token_type_ids`: without it the model silently drops its 3-D vision positions).
    `image_source` is None, or, where rows show the same images (GRPO's responses to one prompt),
    for each image of the rows the distinct image it shows: `media` then holds each distinct image's
    pixel rows once and every row's grid, and the policy encodes each once (models/shared_images.py).
    A batch packed end to end into rows (data/packing.py) holds in `attention_mask` each token's
    sequence number within its row (1, 2, ...; 0 for padding): `is_packed`. The model then needs
    position ids that start again at every sequence and no attention mask (models/packing.py).
    """

    sample_ids: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_source: tuple[int, ...] | None = None

    @property
    def is_packed(self) -> bool:
        """Some row holds more than one sequence (data/packing.py)."""
        return bool(self.attention_mask.max() > 1) if self.attention_mask.numel() else False

    def model_inputs(self) -> dict[str, torch.Tensor]:
        if self.is_packed:  # as a padding mask it would let a sequence see the one before it
            raise ValueError("a packed batch's model inputs come from vlmrun.models.packing.packed_inputs")
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.token_inputs, **self.media}

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass
class PromptBatch:
    """Prompts for generation (left-padded) with the reference answers, for validation and GRPO.

    `token_inputs` are left-padded like `input_ids` (see `Batch`). `templates` names each prompt's
    question template ("" where the data set names none; empty for a batch built without them).
    """

    sample_ids: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    answers: list[str]
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    templates: list[str] = field(default_factory=list)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.token_inputs, **self.media}

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass(frozen=True)
class SampleCounts:
    """What a loader left out of, or cut in, the samples it handed out (see `LoaderShard.counts`).

    `dropped`: samples skipped (unfit under `data.on_bad_sample: drop`, or corrupt); `truncated`:
    SFT conversations cut to `data.max_seq_len` with their media and a labelled token kept.
    """

    dropped: int = 0
    truncated: int = 0

    def __add__(self, other: SampleCounts) -> SampleCounts:
        return SampleCounts(self.dropped + other.dropped, self.truncated + other.truncated)

    @staticmethod
    def total(counts: Iterable[SampleCounts | None]) -> SampleCounts:
        """The sum over loader shards (None: a rank that holds no shard)."""
        return sum((c for c in counts if c is not None), SampleCounts())

    def metrics(self) -> dict[str, int]:
        """The metrics row's keys: `dropped_samples`, `truncated_samples` (since the run began)."""
        return {"dropped_samples": self.dropped, "truncated_samples": self.truncated}


def media_layout(samples) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of a micro-batch's `media.<key>` fields: the encoded samples' (chat_encoding's
    `Encoded`) media concatenated in sample order (none when no sample has any)."""
    shown = [s.media for s in samples if s.media]
    layout = {}
    for k in shown[0] if shown else ():
        first = shown[0][k]
        layout[f"media.{k}"] = ((sum(m[k].shape[0] for m in shown), *first.shape[1:]), first.dtype)
    return layout


def media_into(samples, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The samples' media concatenated in sample order into the `media.<key>` tensors of `out`
    (`media_layout`'s fields), by key."""
    import torch

    media = {}
    for name in out:
        if name.startswith("media."):
            k = name.removeprefix("media.")
            torch.cat([s.media[k] for s in samples if s.media], dim=0, out=out[name])
            media[k] = out[name]
    return media
