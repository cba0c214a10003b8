"""A recipe's reward terms, ready to score: built-in ones and users' functions imported by path.

`reward_terms` imports and checks every term (at submit, and again in every rank: InputError naming
`grpo.rewards[i].fn`); `score_responses` scores every response by every term. A user's function is
held to the contract in this package's doc: what it returns is read strictly, and whatever it raises,
or returns that is not a reward, fails the step with one line naming the function, the sample and what
happened (RewardFailed).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlmrun.errors import InputError, VlmrunError
from vlmrun.rewards.builtin import BUILTINS, Scored


class RewardFailed(VlmrunError):
    """A reward function raised or returned something that is not a reward: the step fails (exit 1)."""


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
    except BaseException as e:  # noqa: BLE001 - the user's module, SystemExit at import included: said in one line
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
        _reward_of(terms, text, sample, done, format_reward)
        for text, sample, done in zip(texts, samples, ended, strict=True)
    ]


def _reward_of(terms, text: str, sample: Mapping[str, Any], ended: bool, format_reward: float) -> Scored:
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
    """(reward, correct, other named numbers) of a user's term on one response, each checked."""
    where = f"the reward function {term.fn_path} (grpo.rewards), on sample {sample.get('sample_id')!r}"
    try:
        out = term.call(text, dict(sample), ended)
    except BaseException as e:  # noqa: BLE001 - the user's function, SystemExit included: fails the step, named
        raise RewardFailed(f"{where} raised {type(e).__name__}: {e}") from None
    if not isinstance(out, Mapping):
        return _number(where, "reward", out), False, {}
    if "reward" not in out:
        raise RewardFailed(f"{where} returned a dict without 'reward' (keys: {sorted(map(str, out))})")
    right = out.get("correct", False)
    if not isinstance(right, bool) and not _is_numpy_bool(right):
        raise RewardFailed(f"{where} gave correct = {right!r} ({type(right).__name__}): True or False is needed")
    extra = {str(k): _number(where, str(k), v) for k, v in out.items() if k not in ("reward", "correct")}
    return _number(where, "reward", out["reward"]), bool(right), extra


def _number(where: str, what: str, value: Any) -> float:
    """`value` as a float when it is a finite real number (any numeric type but bool); RewardFailed otherwise."""
    if isinstance(value, bool) or _is_numpy_bool(value) or not isinstance(value, numbers.Real):
        raise RewardFailed(f"{where} gave {what} = {value!r} ({type(value).__name__}): a real number is needed")
    try:
        number = float(value)
    except (OverflowError, ValueError) as e:
        raise RewardFailed(f"{where} gave {what} = {_short(value)}, which is no float ({e})") from None
    if not math.isfinite(number):
        raise RewardFailed(f"{where} gave {what} = {number}: a finite number is needed")
    return number


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} digits)"
