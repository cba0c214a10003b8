"""The clipped policy-gradient loss of GRPO, per token, normalized by the step's global response tokens.

    ratio_t = exp(logp_t - prev_logp_t)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A) + kl_coef KL_t
    KL_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3: >= 0, unbiased for samples of the policy)

summed over the response tokens of a micro-batch (the policy divides by the global count, as SFT's
NLL). With one inner step the previous logprobs come from a forward of the same weights on the same
micro-batch, so every ratio is exactly 1: `probs_ratio_min` and `probs_ratio_max` say whether that
held. The other statistics compare the generation backend's logprobs with the policy's:
`token_mult_prob_error` = exp(|gen - prev|), `sampling_importance_ratio` = exp(prev - gen) and
`gen_kl_error` = the k3 KL of the generation distribution from the policy's, each summed here and
divided by the global tokens by the caller.
"""

from __future__ import annotations

import torch

from vlmrun.algorithms.grpo.micro_batches import PgMicroBatch
from vlmrun.config.grpo import GrpoConfig
from vlmrun.policy.interface import LossTerms, TokenLoss

#: Statistics summed over tokens (means once divided by the tokens), and the ratio's bounds.
SUMMED = ("kl", "token_mult_prob_error", "sampling_importance_ratio", "gen_kl_error", "clipped")
BOUNDS = ("probs_ratio_min", "probs_ratio_max")


class ClippedPgLoss(TokenLoss):
    def __init__(self, config: GrpoConfig):
        self.clip_low, self.clip_high, self.kl_coef = config.clip_low, config.clip_high, config.kl_coef

    def tokens(self, micro_batch: PgMicroBatch) -> int:
        return int(micro_batch.mask.sum())

    def __call__(self, logp: torch.Tensor, mb: PgMicroBatch) -> LossTerms:
        mask = mb.mask
        ratio = torch.exp(logp - mb.prev_logprobs)
        adv = mb.advantages
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        kl = torch.zeros_like(logp)
        if self.kl_coef > 0:
            kl = k3(mb.ref_logprobs, logp)
            per_token = per_token + self.kl_coef * kl
        total = per_token.masked_fill(~mask, 0.0).sum()
        with torch.no_grad():
            gen, prev, r = mb.generation_logprobs, mb.prev_logprobs, ratio.detach()
            sums = {
                "kl": masked_sum(kl.detach(), mask),
                "token_mult_prob_error": masked_sum(torch.exp((gen - prev).abs()), mask),
                "sampling_importance_ratio": masked_sum(torch.exp(prev - gen), mask),
                "gen_kl_error": masked_sum(k3(prev, gen), mask),
                "clipped": masked_sum(r != clipped.detach(), mask),
            }
        # tensors: the policy brings a step's statistics to the host at once (policy/loss.py LossStats)
        return LossTerms(
            total=total,
            sums=sums,
            mins={"probs_ratio_min": r.masked_fill(~mask, float("inf")).min()},
            maxs={"probs_ratio_max": r.masked_fill(~mask, float("-inf")).max()},
        )


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of `values` where `mask`, a 0-d tensor on their device. On a CPU, the sum of the selected
    values (the bits every CPU run has logged); on a GPU, the masked sum over all of them: boolean
    indexing would wait for the device to learn how many there are, a host sync per statistic."""
    if values.device.type == "cpu":
        return values[mask].sum()
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()


def k3(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || ref) for tokens sampled from p: exp(ref - logp) - (ref - logp) - 1."""
    d = ref - logp
    return torch.exp(d) - d - 1
