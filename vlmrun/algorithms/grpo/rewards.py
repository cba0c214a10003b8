"""Rewards: a registry of scorers from a response's text to a reward, by recipe name (`grpo.reward`).

`clevr_exact`: 1 when the response is the reference answer (whitespace stripped, as validation
scores a greedy answer), plus the format reward `grpo.format_reward`: half of it for a response that
ends its turn (the end-of-turn token, not cut off at max_new_tokens), the other half when it is also
well formed (one answer word: a count, yes or no). The first half is what a model that never saw the
task can earn, so GRPO has a signal from the first step on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Scored:
    """One response's reward, whether it answered correctly, and whether its form earned the bonus."""

    reward: float
    correct: bool
    well_formed: bool


#: (response text, reference answer, ended with end-of-turn, format bonus) -> Scored
Scorer = Callable[[str, str, bool, float], Scored]

_ANSWER_WORD = re.compile(r"\d+|yes|no")


def clevr_exact(text: str, answer: str, ended: bool, format_reward: float) -> Scored:
    """Exact match of a CLEVR answer, plus the format reward (module doc)."""
    said = text.strip()
    correct = said == answer.strip()
    well_formed = ended and _ANSWER_WORD.fullmatch(said) is not None
    form = format_reward * (0.5 * ended + 0.5 * well_formed)
    return Scored(reward=float(correct) + form, correct=correct, well_formed=well_formed)


REWARDS: MappingProxyType[str, Scorer] = MappingProxyType({"clevr_exact": clevr_exact})


def score_responses(
    name: str, texts: Sequence[str], answers: Sequence[str], ended: Sequence[bool], *, format_reward: float
) -> list[Scored]:
    """Every response scored by the reward `name` (a key of REWARDS); the sequences align."""
    scorer = REWARDS[name]
    return [scorer(t, a, e, format_reward) for t, a, e in zip(texts, answers, ended, strict=True)]
