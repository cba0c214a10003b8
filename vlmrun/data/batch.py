"""The batch that the task encoder produces and the policy consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: The label of a position that carries no loss (prompt, padding, image tokens); torch's default ignore_index.
IGNORE_INDEX = -100


@dataclass
class Batch:
    """A micro-batch of encoded conversations, right-padded.

    `labels` are -100 outside assistant tokens (and everywhere in a zero-weight row); `media` holds
    the processor's packed media tensors (e.g. `pixel_values` rows of all images and
    `image_grid_thw`), concatenated in sample order, or is empty for a text-only batch.
    `token_inputs` holds the processor's other per-token inputs, padded like `input_ids` (e.g.
    Qwen2.5-VL's `mm_token_type_ids`: without it the model silently drops its 3-D vision positions).
    """

    sample_ids: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def model_inputs(self) -> dict[str, torch.Tensor]:
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
