"""Throughput ratios of `vlmrun compare` come from interleaved parts: the ratio of each two neighbouring
parts, reported as the median with its spread; `compare v1 v2` alternates its runs part by part.

Fast: hand-written metrics rows and a fake part runner (the real runs: tests/test_sft.py and
../shared/checks/sft.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmrun.launch import compare as launch_compare
from vlmrun.observe.compare import Side, compare_sides, throughput_ratio
from vlmrun.observe.ratios import describe_spread, ratio_spread


def rows(attempts: list[tuple[int, list[int], float, float]]) -> dict[int, dict]:
    """step -> row, from (attempt, steps, rate, start time) per attempt; the first step of each is slow."""
    out = {}
    for attempt, steps, rate, start in attempts:
        for k, step in enumerate(steps):
            out[step] = {
                "step": step,
                "attempt": attempt,
                "loss": 1.0 / step,
                "grad_norm": 1.0,
                "sample_ids": [f"s{step}"],
                "samples_per_s": rate / 10 if k == 0 else rate,
                "time": start + k,
            }
    return out


def test_each_two_neighbouring_parts_give_one_ratio():
    a = Side("v1", Path("a"), rows([(0, [1, 2, 3, 4], 100.0, 0.0), (1, [5, 6, 7, 8], 50.0, 200.0)]))
    b = Side("v2", Path("b"), rows([(0, [1, 2, 3, 4, 5, 6, 7, 8], 80.0, 100.0)]))
    ratio = throughput_ratio(a, b)
    assert [p["run"] for p in ratio["parts"]] == ["v1", "v2", "v1"]  # in the order they ran
    assert [p["steps"] for p in ratio["parts"]] == [[1, 4], [1, 8], [5, 8]]
    assert ratio["runs"] == "v2 / v1" and ratio["rounds"] == 2
    # 80/100 and 80/50: a neighbour's load that halved v1's second part moves the spread, not the median alone
    assert (ratio["min"], ratio["max"], ratio["median"]) == (0.8, 1.6, 1.2)
    assert describe_spread(ratio) == "1.20x (median of 2 rounds, 0.80-1.60)"


def test_runs_taken_one_after_the_other_give_one_round():
    a = Side("A", Path("a"), rows([(0, [1, 2, 3], 100.0, 0.0)]))
    b = Side("B", Path("b"), rows([(0, [1, 2, 3], 150.0, 50.0)]))
    result = compare_sides(a, b)
    assert result["verdict"] == "match"  # the loss comparison is unchanged by the rounds
    assert result["throughput_ratio"]["rounds"] == 1 and result["throughput_ratio"]["median"] == 1.5
    assert describe_spread(result["throughput_ratio"]) == "1.50x (one round)"


def test_ratio_spread_of_no_rounds_says_so():
    assert ratio_spread([])["median"] is None and describe_spread(ratio_spread([])) == "- (no rounds)"
    spread = ratio_spread([1.0, 2.0, 3.0, 10.0])
    assert spread["median"] == 2.5 and spread["q1"] <= spread["median"] <= spread["q3"]


class FakeRuns:
    """Stands in for the submit/resume of `_run_part`: a part stops exactly after `stop_after` (the run's
    `train.stop_after`), or runs to the end."""

    def __init__(self, planned: int):
        self.planned = planned
        self.at: dict[Path, int] = {}
        self.calls: list[tuple[str, int, int | None, bool, int]] = []

    def run_part(self, recipe, sets, run_dir: Path, *, started: bool, stop_after, echo) -> None:
        start = self.at.get(run_dir, 0)
        end = self.planned if stop_after is None else stop_after
        assert start < end <= self.planned  # every part trains at least one step
        self.calls.append((run_dir.name, start + 1, stop_after, started, end))
        self.at[run_dir] = end


@pytest.mark.parametrize(("steps", "rounds", "parts"), [(12, 1, 2), (12, 2, 3), (12, 3, 4), (12, 4, 5), (1, 2, 2)])
def test_compare_v1_v2_alternates_its_runs_part_by_part(tmp_path, monkeypatch, steps, rounds, parts):
    fake = FakeRuns(planned=steps)
    monkeypatch.setattr(launch_compare, "_run_part", fake.run_part)
    monkeypatch.setattr(launch_compare, "_last_step", lambda d: fake.at.get(d, 0))
    monkeypatch.setattr(launch_compare, "_completed", lambda d: fake.at.get(d, 0) >= fake.planned)
    monkeypatch.setattr(launch_compare.RunDirectory, "exists", lambda self: self.path in fake.at)
    dirs = {"v1": tmp_path / "v1", "v2": tmp_path / "v2"}
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"
    launch_compare._run_alternating(recipe, dirs, steps, [], rounds, None)
    runs = [name for name, *_ in fake.calls]
    assert runs == ["v1" if k % 2 == 0 else "v2" for k in range(parts)]  # A B A ...: rounds + 1 parts
    for name in dirs:
        own = [c for c in fake.calls if c[0] == name]
        assert [c[3] for c in own] == [False] + [True] * (len(own) - 1)  # submitted once, then resumed
        assert own[-1][2] is None and fake.at[dirs[name]] == steps  # the last part runs to the planned end
        assert [c[1] for c in own] == [1] + [c[4] + 1 for c in own[:-1]]  # each part goes on where the last ended
        assert [c[4] for c in own] == launch_compare.part_ends(steps, runs.count(name))  # and ends where planned


def test_part_ends_cut_the_steps_evenly():
    assert launch_compare.part_ends(12, 1) == [12]
    assert launch_compare.part_ends(12, 2) == [6, 12]
    assert launch_compare.part_ends(10, 3) == [3, 7, 10]
    assert launch_compare.part_ends(1, 2) == [1, 1]  # fewer steps than parts: the second part has nothing left
