"""Rewards: a GRPO response's reward from its text, as a weighted sum of terms (`grpo.rewards`, or the one
built-in `grpo.reward`). Built-in terms are in builtin.py; terms.py imports users' terms and calls them.

Writing your own term
---------------------
A term is a function named "package.module:function" in the recipe (importable where vlmrun runs: on
PYTHONPATH, or an installed package)::

    def fn(response: str, sample: dict, ended: bool) -> float | dict

- `response`: the response's text; `sample`: the sample's reference fields (`answer`, `sample_id`);
  `ended`: whether the response ended its turn (was not cut off at `grpo.max_new_tokens`).
- It returns the reward, a real number (int, float, or numpy's numeric scalars; not a bool), or a dict
  with `reward` (that number), optionally `correct` (a bool: counts towards the run's `accuracy`) and
  other named numbers, logged as `reward/<term>/<key>`.
- Anything else (a string, a non-finite value, a `correct` that is not a bool), and any exception it
  raises, fails the step with one line naming the function, the sample and what it returned or raised.
- It is called once per response in every rank that scores, so keep it quick and free of side effects.

recipes/rewards/math_answer.py is a worked example. `vlmrun submit` imports and checks every term
before anything starts (InputError naming `grpo.rewards[i].fn`), and every rank imports them again.
This package uses the standard library only: the submit path imports it.
"""
