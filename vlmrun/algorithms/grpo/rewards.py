"""Rewards: each response's reward from its text, as a weighted sum of terms (`grpo.rewards`, or the one
built-in `grpo.reward`).

Built-in terms:

- `clevr_exact`: 1 when the response is the reference answer (whitespace stripped, as validation
  scores a greedy answer), plus the format reward `grpo.format_reward`: half of it for a response that
  ends its turn (the end-of-turn token, not cut off at max_new_tokens), the other half when it is also
  well formed (one answer word: a count, yes or no). The first half is what a model that never saw the
  task can earn, so GRPO has a signal from the first step on.
- `last_number`: for answers inside a free-form response (reasoning, then a result): the value of the
  last `\\boxed{...}` in it, else its last number, against the reference answer as numbers (`3`, `3.0`
  and `3,000` / `3000` compare by value); the format reward as above, its second half for a response
  that gave a value at all.

A user's term is a function named "package.module:function" (importable where vlmrun runs), called as
`fn(response, sample, ended)`: the response's text, the sample's reference fields (`answer`,
`sample_id`) and whether the response ended its turn. It returns the term's reward (a number), or a
dict with `reward`, optionally `correct` (counts towards `accuracy`) and other named numbers, which are
logged (`reward/<term>/<key>`). `reward_terms` imports and checks every term (at submit, and again in
every rank: InputError naming `grpo.rewards[i].fn`); a term that raises while scoring fails the step
with one line naming the function and the sample (RewardFailed). Standard library only: the submit
path imports this module.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmrun.errors import InputError, VlmrunError


class RewardFailed(VlmrunError):
    """A reward function raised or returned something that is not a reward: the step fails (exit 1)."""


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


@dataclass(frozen=True)
class RewardTerm:
    """A term ready to score: its metric name, the `fn` as the recipe wrote it, weight and callable."""

    name: str
    fn_path: str
    weight: float
    call: Callable
    builtin: bool
    logged: bool = True  # its value goes out as reward/<name> (not the built-in `grpo.reward` alone)


def reward_terms(grpo) -> list[RewardTerm]:
    """The terms of the recipe's `grpo` section (`rewards`, or the built-in `reward` alone), every user
    function imported and its signature checked. InputError names the term's field."""
    if not grpo.rewards:
        return [RewardTerm(grpo.reward, grpo.reward, 1.0, BUILTINS[grpo.reward], True, logged=False)]
    terms = []
    for i, t in enumerate(grpo.rewards):
        if t.fn in BUILTINS:
            terms.append(RewardTerm(t.label, t.fn, t.weight, BUILTINS[t.fn], True))
        else:
            terms.append(RewardTerm(t.label, t.fn, t.weight, _import(t.fn, f"grpo.rewards[{i}].fn"), False))
    return terms


def _import(path: str, field_name: str) -> Callable:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module: whatever its import raised, said in one line
        raise InputError(
            field_name,
            path,
            message=f"{field_name}: {path!r}: importing {module_name} failed ({type(e).__name__}: {e}); "
            "it must be importable where vlmrun runs (PYTHONPATH, or an installed package)",
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputError(field_name, path, message=f"{field_name}: {path!r}: {module_name} has no function {attr}")
    try:
        inspect.signature(fn).bind("response", {"answer": ""}, True)
    except TypeError as e:
        raise InputError(
            field_name,
            path,
            message=f"{field_name}: {path!r} cannot be called as fn(response, sample, ended) ({e})",
        ) from None
    except ValueError:  # no signature to read (a builtin or C function): called as it is
        pass
    return fn


def score_responses(
    terms: Sequence[RewardTerm],
    texts: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    ended: Sequence[bool],
    *,
    format_reward: float,
) -> list[Scored]:
    """Every response scored by every term; the sequences align (`samples`: each response's `answer`
    and `sample_id`)."""
    return [
        _score(terms, text, sample, done, format_reward)
        for text, sample, done in zip(texts, samples, ended, strict=True)
    ]


def _score(terms, text: str, sample: Mapping[str, Any], ended: bool, format_reward: float) -> Scored:
    total, correct, well_formed, parts = 0.0, False, False, {}
    for term in terms:
        if term.builtin:
            s = term.call(text, sample["answer"], ended, format_reward)
            value, correct, well_formed = s.reward, correct or s.correct, well_formed or s.well_formed
        else:
            value, right, extra = _call_user(term, text, sample, ended)
            correct = correct or right
            parts |= {f"{term.name}/{k}": v for k, v in extra.items()}
        total += term.weight * value
        if term.logged:
            parts[term.name] = value
    return Scored(reward=total, correct=correct, well_formed=well_formed, parts=parts)


def _call_user(term: RewardTerm, text: str, sample: Mapping[str, Any], ended: bool):
    where = f"the reward function {term.fn_path} (grpo.rewards), on sample {sample.get('sample_id')!r}"
    try:
        out = term.call(text, dict(sample), ended)
    except Exception as e:  # noqa: BLE001 - the user's function: whatever it raised fails the step, named
        raise RewardFailed(f"{where} raised {type(e).__name__}: {e}") from None
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise RewardFailed(f"{where} returned a dict without 'reward' (keys: {sorted(out)})")
        extra = {k: v for k, v in out.items() if k not in ("reward", "correct")}
        value, right = out["reward"], bool(out.get("correct", False))
    else:
        value, right, extra = out, False, {}
    for key, v in {"reward": value, **extra}.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardFailed(f"{where} gave {key} = {v!r}: a finite number is needed")
    return float(value), right, {k: float(v) for k, v in extra.items()}
