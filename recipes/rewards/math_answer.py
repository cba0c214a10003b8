"""An example reward for a task that is not CLEVR: math word problems answered with reasoning, then a
final value in \\boxed{...}. Use it from a recipe with this folder on PYTHONPATH:

    PYTHONPATH=recipes/rewards vlmrun submit recipes/tiny-grpo-cpu.yaml --cluster local \\
        --set 'grpo.rewards=[{fn: math_answer:score}, {fn: math_answer:brevity, weight: 0.1}]'

A reward function is called as fn(response, sample, ended): the response's text, the sample's
reference fields (`answer`, `sample_id`) and whether the response ended its turn (not cut off at
grpo.max_new_tokens). It returns a number, or a dict with `reward`, optionally `correct` (counted in
the run's `accuracy`) and other named numbers (logged as reward/<term>/<key>). It runs in every rank
that scores responses, so it must be importable there and quick (it is called once per response).
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _value(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def score(response: str, sample: dict, ended: bool) -> dict:
    """1 for a final \\boxed{} value equal to the reference (as numbers), 0 otherwise; `boxed` says
    whether the response gave one at all."""
    boxed = _BOXED.findall(response)
    got = _value(boxed[-1]) if boxed else None
    want = _value(str(sample["answer"]))
    correct = got is not None and want is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want))
    return {"reward": float(correct), "correct": correct, "boxed": float(bool(boxed))}


def brevity(response: str, sample: dict, ended: bool) -> float:
    """A small push towards finishing: 1 for a response that ended its turn within 64 words, less
    for longer ones, 0 for one that was cut off."""
    if not ended:
        return 0.0
    return min(1.0, 64 / max(1, len(response.split())))
