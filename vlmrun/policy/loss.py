"""Token-level log-probs and NLL over the tokens that carry a label, normalized by the step's global count.

The policy projects onto the vocabulary only the positions whose next token carries a label
(`scored_positions`: the answer in SFT, the response in GRPO), with transformers' `logits_to_keep`
mask, and takes the log-softmax there alone (`labelled_logprobs`): a CLEVR row has ~300 tokens and
a few labelled ones, and the fp32 logits of the whole sequence were the largest activation of a
step (vocab x tokens x 4 bytes, twice with the log-softmax). The values are those of the whole
sequence's logits (`token_logprobs`, the definition) to fp32 round-off: the same rows of the same
matmul, taken from a smaller one. A `TokenLoss` gets these per-token log-probs, never logits.

`NllLoss` is the `TokenLoss` `train_step` uses when the algorithm gives none (SFT). `LossStats` gathers a
loss's statistics (`LossTerms`) over a rank's micro-batches, then over every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.policy.grad_sync import all_reduce_extreme, all_reduce_sum
from vlmrun.policy.interface import LossTerms, TokenLoss


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the one-position shift of causal LM training."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions whose logits score a labelled next token (position t scores t + 1;
    the last position scores nothing). transformers' `logits_to_keep` takes it as a mask and returns
    the logits of its True positions only, flattened in row-major order: [N, vocab]."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def labelled_logprobs(kept_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label_t+1 | prefix) per position, [B, T-1], float32, 0 where the label is IGNORE_INDEX, from
    the logits of `scored_positions(labels)` alone ([N, vocab], as `logits_to_keep` gives them)."""
    scored = labels[:, 1:] != IGNORE_INDEX
    target = labels[:, 1:][scored]
    if kept_logits.shape[0] != target.shape[0]:
        raise ValueError(f"{kept_logits.shape[0]} rows of logits for {target.shape[0]} labelled tokens")
    picked = torch.log_softmax(kept_logits.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(scored.shape, dtype=torch.float32, device=labels.device).masked_scatter(scored, picked)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The definition `labelled_logprobs` computes, from the logits of every position [B, T, vocab]:
    log p(label_t+1 | prefix) per position, [B, T-1], float32; 0 where the label is IGNORE_INDEX."""
    target = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(target == IGNORE_INDEX, 0.0)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token NLL over positions whose label is not IGNORE_INDEX, in float32, from
    the logits of every position (the definition `NllLoss` computes from labelled log-probs)."""
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    target = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted, target, ignore_index=IGNORE_INDEX, reduction="sum")


class NllLoss(TokenLoss):
    """Next-token NLL of a `Batch`'s labels (positions labelled IGNORE_INDEX carry none)."""

    def tokens(self, micro_batch) -> int:
        return valid_tokens(micro_batch.labels)

    def __call__(self, logprobs: torch.Tensor, micro_batch) -> LossTerms:
        return LossTerms(total=-logprobs.sum())


class LossStats:
    """A loss's statistics over this rank's micro-batches, then over all ranks (`LossTerms`)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, terms: LossTerms) -> None:
        for k, v in terms.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in terms.mins.items():
            self.mins[k] = min(self.mins.get(k, float("inf")), v)
        for k, v in terms.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, float("-inf")), v)

    def reduced(self) -> dict[str, float]:
        """Every statistic over all ranks; the same keys on every rank (collectives in sorted key order)."""
        out: dict[str, float] = {}
        for values, reduce in (
            (self.sums, all_reduce_sum),
            (self.mins, lambda v: all_reduce_extreme(v, largest=False)),
            (self.maxs, lambda v: all_reduce_extreme(v, largest=True)),
        ):
            keys = sorted(values)
            if keys:
                out |= dict(zip(keys, reduce([values[k] for k in keys]), strict=True))
        return out
