"""Config of sync GRPO: how many responses per prompt, how they are sampled, rewarded and trained on.

In GRPO `train.global_batch_size` and `train.micro_batch_size` count prompts: each prompt brings
`num_generations` responses, so a micro-batch holds `micro_batch_size x num_generations` responses.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.section import Section

#: The rewards vlmrun ships (vlmrun/rewards/builtin.py); any other `fn` is "package.module:function".
BUILTIN_REWARDS = ("clevr_exact", "last_number")


class RewardTerm(Section):
    """One term of the reward: a built-in name or a user's function, and its weight in the sum."""

    fn: str = Field(
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*|[a-z_]+)$",
        description=f"a built-in reward ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function', importable "
        "where vlmrun runs (PYTHONPATH): fn(response: str, sample: dict, ended: bool) -> float, or a dict "
        "with 'reward' (and optionally 'correct' and other named numbers, logged as reward/<name>/<key>)",
    )
    weight: float = Field(1.0, description="the term's weight in the response's reward")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the term's metric name (default: the function's)"
    )

    @property
    def label(self) -> str:
        return self.name or self.fn.rsplit(":", 1)[-1]


class GrpoConfig(Section):
    num_generations: int = Field(4, ge=2, le=256, description="responses per prompt (the group size G)")
    max_new_tokens: int = Field(8, ge=1, description="longest response, in tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (> 0: greedy groups have no spread)")
    top_p: float = Field(1.0, gt=0, le=1)
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="ratio clipped above at 1 + clip_high")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the initial policy; 0 = off")
    inner_steps: int = Field(
        1, ge=1, description="optimizer steps per rollout: each takes 1/inner_steps of every replica's micro-batches"
    )
    normalize_std: bool = Field(True, description="divide advantages by the group's reward std")
    reward: Literal[BUILTIN_REWARDS] = Field(
        "clevr_exact",
        description="the reward when grpo.rewards is empty: clevr_exact (the answer word) or last_number (the "
        "last number, or the \\boxed{} value, of a free-form response against the reference)",
    )
    rewards: list[RewardTerm] = Field(
        default_factory=list,
        description="the reward as a weighted sum of terms, each logged as reward/<name>; empty: grpo.reward "
        "alone. Each fn is imported and checked at submit and on every node",
    )
    format_reward: float = Field(
        0.1,
        ge=0,
        description="half for ending the turn, half more for a well-formed answer (one word, then end of turn)",
    )
