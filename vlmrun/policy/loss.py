"""Token-level log-probs and NLL over the tokens that carry a label, normalized by the step's global count.

The policy projects onto the vocabulary only the positions whose next token carries a label
(`scored_positions`: the answer in SFT, the response in GRPO), with transformers' `logits_to_keep`
mask, and takes the log-softmax there alone (`labelled_logprobs`): a CLEVR row has ~300 tokens and
a few labelled ones, and the fp32 logits of the whole sequence were the largest activation of a
step (vocab x tokens x 4 bytes, twice with the log-softmax). The values are those of the whole
sequence's logits (`token_logprobs`, the definition) to fp32 round-off: the same rows of the same
matmul, taken from a smaller one. A `TokenLoss` gets these per-token log-probs, never logits.

transformers before 5.20 read a tensor `logits_to_keep` only as positions kept in every row
(`hidden_states[:, keep]`): a 2-D mask raises IndexError there. `logits_to_keep` passes such a
transformers the columns any row scores instead, and `kept_logits` takes each row's own out of them
(the same values to fp32 round-off: a wider matmul); with a transformers that takes the mask
(`slice_logits_to_keep`), the mask itself, and the bits stay those of the mask.

`NllLoss` is the `TokenLoss` `train_step` uses when the algorithm gives none (SFT). `LossStats` gathers a
loss's statistics (`LossTerms`) over a rank's micro-batches, then over every rank; values may be
tensors on the device, brought to the host together once a step (one copy, not one a value).
"""

from __future__ import annotations

import functools

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


@functools.cache
def takes_a_mask() -> bool:
    """Whether the installed transformers reads a 2-D boolean `logits_to_keep` as a mask (module doc)."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")


def logits_to_keep(keep: torch.Tensor) -> torch.Tensor:
    """What to pass transformers as `logits_to_keep` for the [B, T] mask `keep` (module doc)."""
    return keep if takes_a_mask() else keep.any(dim=0).nonzero().squeeze(-1)


def kept_logits(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The logits of `keep`'s True positions, [N, vocab] in row-major order, from what the model returned
    for `logits_to_keep(keep)`: those already, or [B, K, vocab] over the columns any row keeps."""
    if logits.dim() == 2:
        return logits
    return logits[keep[:, keep.any(dim=0)]]


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
    """A loss's statistics over this rank's micro-batches, then over all ranks (`LossTerms`). Values
    (floats, or 0-d tensors on the device) are kept as they come and brought to the host in `reduced`:
    one copy for the step; the sums are then added in micro-batch order, as floats, as they always were."""

    def __init__(self):
        self._terms: list[LossTerms] = []

    def add(self, terms: LossTerms) -> None:
        self._terms.append(terms)

    def on_host(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(sums, mins, maxs) over this rank's micro-batches, as floats: one copy to the host."""
        values = [v for t in self._terms for part in (t.sums, t.mins, t.maxs) for v in part.values()]
        floats = iter(_host_floats(values))
        sums: dict[str, float] = {}
        mins: dict[str, float] = {}
        maxs: dict[str, float] = {}
        for t in self._terms:
            for k in t.sums:
                sums[k] = sums.get(k, 0.0) + next(floats)
            for k in t.mins:
                mins[k] = min(mins.get(k, float("inf")), next(floats))
            for k in t.maxs:
                maxs[k] = max(maxs.get(k, float("-inf")), next(floats))
        return sums, mins, maxs

    def reduced(self) -> dict[str, float]:
        """Every statistic over all ranks; the same keys on every rank (collectives in sorted key order)."""
        sums, mins, maxs = self.on_host()
        out: dict[str, float] = {}
        for values, reduce in (
            (sums, all_reduce_sum),
            (mins, lambda v: all_reduce_extreme(v, largest=False)),
            (maxs, lambda v: all_reduce_extreme(v, largest=True)),
        ):
            keys = sorted(values)
            if keys:
                out |= dict(zip(keys, reduce([values[k] for k in keys]), strict=True))
        return out


def _host_floats(values: list) -> list[float]:
    """`values` (floats, ints or 0-d tensors) as floats, every tensor copied to the host in one transfer;
    each the float `float(value)` would give (fp64 holds every fp32 and int32 value exactly)."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    host = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist())
    return [next(host) if torch.is_tensor(v) else float(v) for v in values]
