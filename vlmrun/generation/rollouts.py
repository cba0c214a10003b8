"""Rollouts: the responses a generation backend sampled, with what the GRPO stages need from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vlmrun.data.batch import IGNORE_INDEX, Batch, PromptBatch


@dataclass
class Rollouts:
    """`group_size` responses to each of a batch of prompts; row i*group_size + g is response g to prompt i.

    `prompt_ids` are left-padded (the prompt batch's width), `response_ids` right-padded with
    `pad_token_id` after the end-of-turn token. `response_mask` is 1 on the sampled tokens up to and
    including the first end-of-turn token. `logprobs` are log p(token | prefix) under the raw logits,
    float32, 0 where the mask is 0. `media` and `token_inputs` are the prompts' (per row, in row
    order); `answers` are the prompts' reference answers, for rewards. `generate_s` is the wall time
    of the generate call (the slowest replica's for a group).
    """

    group_size: int
    sample_ids: list[str]
    answers: list[str]
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    pad_token_id: int
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    generate_s: float = 0.0

    @classmethod
    def sampled(
        cls,
        prompts: PromptBatch,
        *,
        n: int,
        response_ids: torch.Tensor,
        mask: torch.Tensor,
        logprobs: torch.Tensor,
        pad_token_id: int,
        generate_s: float,
    ) -> Rollouts:
        """What a backend sampled for `prompts` (each prompt's row already repeated `n` times, in order):
        the responses padded with `pad_token_id` and their log-probs zeroed where `mask` is 0."""
        return cls(
            group_size=n,
            sample_ids=prompts.sample_ids,
            answers=prompts.answers,
            prompt_ids=prompts.input_ids,
            prompt_mask=prompts.attention_mask,
            response_ids=response_ids.masked_fill(mask == 0, pad_token_id),
            response_mask=mask,
            logprobs=logprobs.masked_fill(mask == 0, 0.0),
            pad_token_id=pad_token_id,
            media=prompts.media,
            token_inputs=prompts.token_inputs,
            generate_s=generate_s,
        )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def training_batch(self) -> Batch:
        """Prompt + response as one batch for a teacher-forced forward; labels on the response tokens only.

        Per-token inputs are 0 on the response (text; Qwen's `mm_token_type_ids`), so the policy scores
        the response exactly as generation saw it. `PolicyBackend.logprobs(batch)` of it, read through
        `response_logprobs`, lines up with `logprobs`.
        """
        responses = self.response_ids.masked_fill(self.response_mask == 0, self.pad_token_id)
        labels = torch.full_like(self.prompt_ids, IGNORE_INDEX)
        return Batch(
            sample_ids=list(self.sample_ids),
            input_ids=torch.cat([self.prompt_ids, responses], dim=1),
            attention_mask=torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1),
            labels=torch.cat([labels, responses.masked_fill(self.response_mask == 0, IGNORE_INDEX)], dim=1),
            media=dict(self.media),
            token_inputs={
                k: torch.cat([v, torch.zeros_like(responses, dtype=v.dtype)], dim=1)
                for k, v in self.token_inputs.items()
            },
        )

    def response_logprobs(self, token_logprobs: torch.Tensor) -> torch.Tensor:
        """The response part, [N, R], of `token_logprobs` [N, T-1] of `training_batch()` (position t scores t+1)."""
        start = self.prompt_ids.shape[1] - 1
        return token_logprobs[:, start : start + self.response_ids.shape[1]]

    @classmethod
    def concat(cls, parts: Sequence[Rollouts]) -> Rollouts:
        """Rows of `parts` in order (shares of one prompt batch: same prompt width and group size)."""
        first = parts[0]
        width = max(p.response_ids.shape[1] for p in parts)

        def cat(name: str, value: float) -> torch.Tensor:
            tensors = [getattr(p, name) for p in parts]
            padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
            return torch.cat(padded)

        with_media = [p.media for p in parts if p.media]
        return cls(
            group_size=first.group_size,
            sample_ids=[s for p in parts for s in p.sample_ids],
            answers=[a for p in parts for a in p.answers],
            prompt_ids=torch.cat([p.prompt_ids for p in parts]),
            prompt_mask=torch.cat([p.prompt_mask for p in parts]),
            response_ids=cat("response_ids", first.pad_token_id),
            response_mask=cat("response_mask", 0),
            logprobs=cat("logprobs", 0.0),
            pad_token_id=first.pad_token_id,
            media={k: torch.cat([m[k] for m in with_media]) for k in with_media[0]} if with_media else {},
            token_inputs={k: torch.cat([p.token_inputs[k] for p in parts]) for k in first.token_inputs},
            generate_s=max(p.generate_s for p in parts),
        )


def response_mask(response_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """1 on every response token up to and including the first of `eos_token_ids`, 0 after it (long)."""
    is_eos = torch.isin(response_ids, torch.tensor(list(eos_token_ids), device=response_ids.device))
    ended_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return (~ended_before).long()
