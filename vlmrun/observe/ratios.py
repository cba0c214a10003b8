"""Ratios measured in interleaved rounds, reported as their median with the spread over the rounds.

On a shared machine a neighbour's load comes and goes within seconds: two measurements taken one after
the other can differ by 2x (a `compare v1 v2` throughput ratio read 0.64x and 2.07x in two runs). So a
ratio users read is taken in rounds, each round measuring both sides close together in time, and
reported as the median of the per-round ratios (a burst that lands in one round does not decide it)
with their minimum, maximum and quartiles (how much the noise moved it).
"""

from __future__ import annotations

import statistics


def round_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """numerator / denominator of each round (rounds with a zero denominator are left out)."""
    return [n / d for n, d in zip(numerators, denominators, strict=True) if d]


def ratio_spread(ratios: list[float], digits: int = 3) -> dict:
    """{"median", "min", "max", "q1", "q3", "rounds"} of per-round ratios, rounded to `digits`
    (median and the rest None when there are no rounds)."""
    if not ratios:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "rounds": 0}
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median": round(statistics.median(ratios), digits),
        "min": round(min(ratios), digits),
        "max": round(max(ratios), digits),
        "q1": round(q1, digits),
        "q3": round(q3, digits),
        "rounds": len(ratios),
    }


def describe_spread(spread: dict) -> str:
    """One line for a table: "1.08x (median of 10 rounds, 0.97-1.21)"."""
    if spread["median"] is None:
        return "- (no rounds)"
    if spread["rounds"] == 1:
        return f"{spread['median']:.2f}x (one round)"
    return f"{spread['median']:.2f}x (median of {spread['rounds']} rounds, {spread['min']:.2f}-{spread['max']:.2f})"
