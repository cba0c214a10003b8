"""The built-in reward terms, and `Scored`, one response's reward as every term counts it.

- `clevr_exact`: 1 when the response is the reference answer (whitespace stripped, as validation scores
  a greedy answer), plus the format reward `grpo.format_reward`: half of it for a response that ends its
  turn (the end-of-turn token, not cut off at max_new_tokens), the other half when it is also well formed
  (one answer word: a count, yes or no). The first half is what a model that never saw the task can
  earn, so GRPO has a signal from the first step on.
- `last_number`: for answers inside a free-form response (reasoning, then a result): the value of the
  last `\\boxed{...}` in it, else its last number, against the reference answer as numbers (`3`, `3.0`
  and `3,000` / `3000` compare by value); the format reward as above, its second half for a response
  that gave a value at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scored:
    """One response's reward, whether it answered correctly, whether its form earned the bonus, and
    each term's value (`parts`, by metric name; empty for the built-in `grpo.reward` alone)."""

    reward: float
    correct: bool
    well_formed: bool
    parts: dict[str, float] = field(default_factory=dict)


_ANSWER_WORD = re.compile(r"\d+|yes|no")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def clevr_exact(text: str, answer: str, ended: bool, format_reward: float) -> Scored:
    """Exact match of a CLEVR answer, plus the format reward (module doc)."""
    said = text.strip()
    correct = said == answer.strip()
    well_formed = ended and _ANSWER_WORD.fullmatch(said) is not None
    form = format_reward * (0.5 * ended + 0.5 * well_formed)
    return Scored(reward=float(correct) + form, correct=correct, well_formed=well_formed)


def final_value(text: str) -> float | None:
    """The value a free-form response ends on: its last \\boxed{...} (a number inside it), else its last
    number; None when it gives none."""
    boxed = _BOXED.findall(text)
    candidates = _NUMBER.findall(boxed[-1]) if boxed else _NUMBER.findall(text)
    return _number(candidates[-1]) if candidates else None


def last_number(text: str, answer: str, ended: bool, format_reward: float) -> Scored:
    """The response's final value against the reference, as numbers, plus the format reward (module doc)."""
    got, want = final_value(text), _number(answer.strip())
    correct = got is not None and want is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    well_formed = ended and got is not None
    form = format_reward * (0.5 * ended + 0.5 * well_formed)
    return Scored(reward=float(correct) + form, correct=correct, well_formed=well_formed)


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


#: (response text, reference answer, ended with end-of-turn, format bonus) -> Scored
Scorer = Callable[[str, str, bool, float], Scored]
BUILTINS: dict[str, Scorer] = {"clevr_exact": clevr_exact, "last_number": last_number}
