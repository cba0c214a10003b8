"""Rewards with hand-made inputs: the built-in terms, users' terms imported by path and weighted, and a
user's result read strictly (a real number, an optional bool `correct`; anything else, and anything it
raises, fails the step naming the function and the sample). Through a real GRPO run: test_grpo_rewards.py."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from vlmrun.config.grpo import BUILTIN_REWARDS
from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.rewards.builtin import BUILTINS, clevr_exact, last_number
from vlmrun.rewards.terms import RewardFailed, reward_terms, score_responses

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "recipes" / "tiny-grpo-cpu.yaml"


def test_clevr_reward_is_exact_match_plus_a_small_format_reward():
    assert clevr_exact(" 2 ", "2", True, 0.1).reward == pytest.approx(1.1)  # right, ended, one answer word
    assert clevr_exact("3", "2", True, 0.1).reward == pytest.approx(0.1)  # wrong but well formed
    assert clevr_exact("two objects", "2", True, 0.1).reward == pytest.approx(0.05)  # ended its turn only
    assert clevr_exact("yes", "yes", False, 0.1).reward == pytest.approx(1.0)  # cut off: no format reward
    assert clevr_exact("Yes", "yes", True, 0.1).correct is False  # exact, as validation scores it
    terms = reward_terms(load_recipe(GRPO).grpo)  # grpo.reward alone: no term logged of its own
    scored = score_responses(terms, ["1", "no"], [{"answer": "1"}, {"answer": "yes"}], [True, True], format_reward=0.0)
    assert [s.reward for s in scored] == [1.0, 0.0] and [s.parts for s in scored] == [{}, {}]
    assert set(BUILTINS) == set(BUILTIN_REWARDS) == {"clevr_exact", "last_number"}


def test_last_number_reads_the_boxed_value_or_the_last_number_of_a_free_form_response():
    assert last_number("2 + 3 = 5, so \\boxed{5}.", "5", True, 0.1).reward == pytest.approx(1.1)
    assert last_number("It is 3000 or so... final: 3,000", "3000", True, 0.0).correct  # by value
    assert last_number("\\boxed{2.50} not 7", "2.5", False, 0.1).reward == pytest.approx(1.0)  # boxed wins
    assert not last_number("There are 4 cubes and 2 spheres", "4", True, 0.0).correct  # the last number: 2
    none = last_number("I cannot tell", "4", True, 0.1)
    assert (none.correct, none.well_formed, none.reward) == (False, False, pytest.approx(0.05))


def write_module(folder: Path, body: str, name: str = "user_rewards") -> str:
    (folder / f"{name}.py").write_text(body)
    return name


def test_user_terms_are_imported_weighted_and_logged_by_name(tmp_path, monkeypatch):
    module = write_module(
        tmp_path,
        "def brevity(response, sample, ended):\n"
        "    words = len(response.split())\n"
        "    return {'reward': 1.0 / max(words, 1), 'correct': response.strip() == sample['answer'], 'words': words}\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = f"grpo.rewards=[{{fn: {module}:brevity, weight: 0.5, name: short}}, {{fn: clevr_exact}}]"
    terms = reward_terms(load_recipe(GRPO, [rewards]).grpo)
    (a, b) = score_responses(terms, ["2", "two of them"], [{"answer": "2"}] * 2, [True, True], format_reward=0.1)
    assert a.reward == pytest.approx(0.5 * 1.0 + 1.1) and a.correct and a.well_formed
    assert a.parts == {"short": 1.0, "short/words": 1.0, "clevr_exact": pytest.approx(1.1)}
    assert b.reward == pytest.approx(0.5 / 3 + 0.05) and not b.correct and b.parts["short/words"] == 3.0


@pytest.mark.parametrize(
    "body, fn, words",
    [
        ("x = 1\n", "rewards_a:nope", "has no function nope"),
        (
            "def two(response, sample):\n    return 1.0\n",
            "rewards_b:two",
            "cannot be called as fn(response, sample, ended)",
        ),
        (
            "raise ImportError('needs a GPU library')\n",
            "rewards_c:f",
            "importing rewards_c failed (ImportError: needs a GPU",
        ),
        ("", "no_such_module_anywhere:f", "importing no_such_module_anywhere failed (ModuleNotFoundError"),
    ],
)
def test_a_user_term_that_cannot_be_called_is_refused_naming_its_field(tmp_path, monkeypatch, body, fn, words):
    if body:  # else no module of that name anywhere
        write_module(tmp_path, body, name=fn.split(":")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe(GRPO, [f"grpo.rewards=[{{fn: clevr_exact}}, {{fn: {fn}}}]"])
    with pytest.raises(InputError, match=r"^grpo\.rewards\[1\]\.fn: ") as e:
        reward_terms(recipe.grpo)
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(
    "body, words",
    [
        ("    raise KeyError('bbox')\n", "raised KeyError: 'bbox'"),
        ("    return {'score': 1.0}\n", "returned a dict without 'reward'"),
        ("    return float('nan')\n", "gave reward = nan: a finite number is needed"),
    ],
)
def test_a_user_term_that_fails_while_scoring_names_itself_and_the_sample(tmp_path, monkeypatch, body, words):
    name = f"failing_{abs(hash(body))}"
    write_module(tmp_path, "def f(response, sample, ended):\n" + body, name=name)
    monkeypatch.syspath_prepend(str(tmp_path))
    terms = reward_terms(load_recipe(GRPO, [f"grpo.rewards=[{{fn: {name}:f}}]"]).grpo)
    with pytest.raises(RewardFailed) as e:
        score_responses(terms, ["2"], [{"answer": "2", "sample_id": "s-7"}], [True], format_reward=0.1)
    msg = str(e.value)
    assert msg.startswith(f"the reward function {name}:f (grpo.rewards), on sample 's-7' ") and words in msg


def test_the_example_reward_module_scores_a_math_answer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "recipes" / "rewards"))
    rewards = "grpo.rewards=[{fn: math_answer:score}, {fn: math_answer:brevity, weight: 0.1}]"
    terms = reward_terms(load_recipe(GRPO, [rewards]).grpo)
    right, wrong = score_responses(
        terms,
        ["12 apples, 3 eaten: 12 - 3 = 9. \\boxed{9}", "I think it is 9"],
        [{"answer": "9", "sample_id": "q1"}] * 2,
        [True, False],
        format_reward=0.1,
    )
    assert right.correct and right.reward == pytest.approx(1.1) and right.parts["score/boxed"] == 1.0
    assert (
        not wrong.correct and wrong.reward == 0.0 and wrong.parts == {"score": 0.0, "score/boxed": 0.0, "brevity": 0.0}
    )


def _score_one(tmp_path, monkeypatch, body: str):
    """The one response "2" of sample 's-7' scored by a user's term `f` whose body is `body`."""
    name = f"strict_{abs(hash(body))}"
    write_module(tmp_path, "import numpy as np\n\n\ndef f(response, sample, ended):\n" + body, name=name)
    monkeypatch.syspath_prepend(str(tmp_path))
    terms = reward_terms(load_recipe(GRPO, [f"grpo.rewards=[{{fn: {name}:f}}]"]).grpo)
    return name, score_responses(terms, ["2"], [{"answer": "2", "sample_id": "s-7"}], [True], format_reward=0.0)[0]


@pytest.mark.parametrize(
    "body, reward, correct",
    [
        ("    return np.float32(0.5)\n", 0.5, False),
        ("    return np.int64(2)\n", 2.0, False),
        ("    return {'reward': np.float64(0.25), 'correct': np.bool_(True), 'n': np.int32(3)}\n", 0.25, True),
        ("    from fractions import Fraction\n    return Fraction(1, 4)\n", 0.25, False),
        ("    return {'reward': 1, 'correct': False}\n", 1.0, False),
    ],
)
def test_any_real_number_is_a_reward_and_correct_is_a_bool(tmp_path, monkeypatch, body, reward, correct):
    _, scored = _score_one(tmp_path, monkeypatch, body)
    assert scored.reward == reward and scored.correct is correct and type(scored.reward) is float
    assert all(type(v) is float for v in scored.parts.values())
    assert Fraction(1, 4) == 0.25  # the numeric tower: what `numbers.Real` admits


@pytest.mark.parametrize(
    "body, words",
    [
        ("    return {'reward': 1.0, 'correct': 'no'}\n", "gave correct = 'no' (str): True or False is needed"),
        ("    return {'reward': 1.0, 'correct': 1}\n", "gave correct = 1 (int): True or False is needed"),
        ("    return 10**400\n", "gave reward = 10000000000000000000...0000000000 (401 digits), which is no float"),
        ("    return '0.5'\n", "gave reward = '0.5' (str): a real number is needed"),
        ("    return True\n", "gave reward = True (bool): a real number is needed"),
        ("    return {'reward': 1.0, 'n': 'many'}\n", "gave n = 'many' (str): a real number is needed"),
        ("    return np.float32('inf')\n", "gave reward = inf: a finite number is needed"),
        ("    raise SystemExit(3)\n", "raised SystemExit: 3"),
        ("    raise KeyboardInterrupt()\n", "raised KeyboardInterrupt"),
    ],
)
def test_a_result_that_is_not_a_reward_fails_the_step_naming_function_sample_and_value(
    tmp_path, monkeypatch, body, words
):
    with pytest.raises(RewardFailed) as e:
        _score_one(tmp_path, monkeypatch, body)
    msg = str(e.value)
    assert msg.startswith("the reward function strict_") and "(grpo.rewards), on sample 's-7' " in msg
    assert words in msg and len(msg.splitlines()) == 1


@pytest.mark.parametrize("raised", ["SystemExit(0)", "SystemExit('no GPU here')", "KeyboardInterrupt()"])
def test_a_module_that_exits_at_import_is_refused_naming_its_field(tmp_path, monkeypatch, raised):
    name = write_module(tmp_path, f"raise {raised}\n", name=f"exits_{abs(hash(raised))}")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InputError, match=rf"^grpo\.rewards\[0\]\.fn: '{name}:f': importing {name} failed \("):
        reward_terms(load_recipe(GRPO, [f"grpo.rewards=[{{fn: {name}:f}}]"]).grpo)
