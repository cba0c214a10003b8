"""Token-level NLL over assistant tokens, normalized by the step's global count of valid tokens.

`NllLoss` is the `TokenLoss` `train_step` uses when the algorithm gives none (SFT).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.policy.interface import LossTerms, TokenLoss


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the one-position shift of causal LM training."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token NLL over positions whose label is not IGNORE_INDEX, in float32."""
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    target = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted, target, ignore_index=IGNORE_INDEX, reduction="sum")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label_t+1 | prefix) per position, [B, T-1], float32; 0 where the label is IGNORE_INDEX."""
    target = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(target == IGNORE_INDEX, 0.0)


class NllLoss(TokenLoss):
    """Next-token NLL of a `Batch`'s labels (positions labelled IGNORE_INDEX carry none)."""

    def tokens(self, micro_batch) -> int:
        return valid_tokens(micro_batch.labels)

    def __call__(self, logits: torch.Tensor, micro_batch) -> LossTerms:
        return LossTerms(total=nll_sum(logits, micro_batch.labels))
