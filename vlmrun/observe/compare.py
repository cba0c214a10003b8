"""Compare two runs step by step: max abs/rel differences per metric, sample ids, throughput, a plot, a verdict.

The throughput ratio (B over A) is taken part by part: a part is one attempt's steps (a `compare v1 v2`
run advances its two runs in alternating parts, launch/compare.py), parts are put in the order they
ran, and every two neighbouring parts of different runs give one ratio of their median rates. The
median of those ratios, with their spread, is what the table and `throughput_ratio` report: two runs
taken one after the other give one ratio, and the spread says how far to trust it.

A verdict "diverged" always comes with its `reasons`. A run whose metrics end in a torn last line (a
killed writer's half row) is compared on its whole rows: the torn row is named under `skipped`, and its
step, when the other run has it, is compared on neither side rather than counted as a divergence.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.observe.ratios import ratio_spread
from vlmrun.run.metrics import TornRow, history

METRICS = ("loss", "grad_norm")


@dataclass
class Side:
    label: str
    run_dir: Path
    rows: dict[int, dict]
    torn: list[TornRow] = field(default_factory=list)  # the torn last line its reader skipped, if any


def load_side(label: str, run_dir: Path, metrics_file: str = "metrics.jsonl") -> Side:
    """The rows of one run; InputError naming the file when it is missing, empty or damaged (run/metrics.py)."""
    path = Path(run_dir) / metrics_file
    if not path.is_file():
        raise InputError("RUN", str(run_dir), message=f"{run_dir}: no {metrics_file} (is it a vlmrun run directory?)")
    torn: list[TornRow] = []
    rows = history(path, torn)
    if not rows:
        raise InputError("RUN", str(run_dir), message=f"{path}: no step rows yet")
    return Side(label, Path(run_dir), rows, torn)


def compare_sides(a: Side, b: Side, *, rtol: float = 0.0, out_dir: Path | None = None) -> dict:
    """The comparison as a JSON-able dict; `verdict` is "match" when every metric is within `rtol`."""
    steps = sorted(set(a.rows) & set(b.rows))
    unknown = {t.step for s in (a, b) for t in s.torn if t.step is not None and t.step not in s.rows}
    only = sorted((set(a.rows) ^ set(b.rows)) - unknown)
    max_abs, max_rel, first_diff = {}, {}, {}
    for m in METRICS:
        diffs = []
        for s in steps:
            va, vb = a.rows[s].get(m), b.rows[s].get(m)
            if va is None or vb is None:
                continue
            d = abs(va - vb)
            diffs.append((s, d, d / max(abs(va), abs(vb), 1e-30)))
        max_abs[m] = max((d for _, d, _ in diffs), default=0.0)
        max_rel[m] = max((r for _, _, r in diffs), default=0.0)
        over = [s for s, d, r in diffs if (r > rtol if rtol > 0 else d != 0.0)]
        if over:
            first_diff[m] = over[0]
    id_mismatch = [s for s in steps if a.rows[s].get("sample_ids") != b.rows[s].get("sample_ids")]
    reasons = _reasons(a, b, steps, only, first_diff, id_mismatch, rtol)
    result = {
        "verdict": "diverged" if reasons else "match",
        "reasons": reasons,
        "skipped": [t.describe() for s in (a, b) for t in s.torn],
        "runs": {a.label: str(a.run_dir), b.label: str(b.run_dir)},
        "steps_compared": len(steps),
        "steps_only_in_one": only[:20],
        "rtol": rtol,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "first_step_over_tolerance": first_diff,
        "sample_ids_identical": not id_mismatch,
        "first_sample_id_mismatch": id_mismatch[0] if id_mismatch else None,
        "throughput": {s.label: _throughput(s) for s in (a, b)},
        "throughput_ratio": throughput_ratio(a, b),
        "peak_rss_mb": {s.label: max((r.get("peak_rss_mb") or 0) for r in s.rows.values()) for s in (a, b)},
        "plot": None,
    }
    if out_dir is not None:
        result["plot"] = str(plot(a, b, Path(out_dir) / f"compare-{a.label}-vs-{b.label}.png"))
    return result


def _reasons(a: Side, b: Side, steps: list, only: list, first_diff: dict, id_mismatch: list, rtol: float) -> list:
    """Why the runs diverged, one line each (none: they match)."""
    reasons = [] if steps else ["no step in common"]
    for side in (a, b):
        mine = [s for s in only if s in side.rows]
        if mine:
            reasons.append(f"{len(mine)} step(s) only in {side.label}: {_spans(mine)}")
    bound = f"more than rtol {rtol:g}" if rtol > 0 else "not bitwise equal"
    reasons += [f"{m} {bound} from step {s}" for m, s in first_diff.items()]
    if id_mismatch:
        reasons.append(f"sample ids differ from step {id_mismatch[0]}")
    return reasons


def _spans(steps: list[int]) -> str:
    """'3, 7-9' of sorted steps."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(x) if x == y else f"{x}-{y}" for x, y in spans)


def _throughput(side: Side) -> dict:
    rows = [side.rows[s] for s in sorted(side.rows)]
    steady = rows[1:] or rows  # the first step carries start-up costs

    def median(key: str, digits: int) -> float | None:
        values = [r[key] for r in steady if r.get(key)]
        return round(statistics.median(values), digits) if values else None

    return {
        "samples_per_s": median("samples_per_s", 3),
        "tokens_per_s": median("tokens_per_s", 2),
        "step_time_s": median("step_time_s", 4),
    }


def throughput_ratio(a: Side, b: Side, key: str = "samples_per_s") -> dict:
    """B's `key` over A's, per pair of neighbouring parts (module docstring): the spread of the ratios
    (vlmrun.observe.ratios) and the parts they came from, in the order they ran."""
    parts = sorted((p for side in (a, b) for p in _parts(side, key)), key=lambda p: p["started"])
    ratios = [
        (y["rate"] / x["rate"]) if x["run"] == a.label else (x["rate"] / y["rate"])
        for x, y in zip(parts, parts[1:], strict=False)
        if x["run"] != y["run"] and x["rate"] and y["rate"]
    ]
    shown = [{"run": p["run"], "steps": p["steps"], key: round(p["rate"], 3)} for p in parts]
    return {"of": key, "runs": f"{b.label} / {a.label}", **ratio_spread(ratios), "parts": shown}


def _parts(side: Side, key: str) -> list[dict]:
    """One part per attempt of `side`: its steps and the median `key` of them (its first step, which
    carries the attempt's start-up, left out when there are more)."""
    by_attempt: dict[int, list[dict]] = {}
    for step in sorted(side.rows):
        by_attempt.setdefault(side.rows[step].get("attempt", 0), []).append(side.rows[step])
    parts = []
    for rows in by_attempt.values():
        values = [r[key] for r in (rows[1:] or rows) if r.get(key)]
        if values:
            started = rows[0].get("time", 0.0)
            steps = [rows[0]["step"], rows[-1]["step"]]
            parts.append({"started": started, "run": side.label, "steps": steps, "rate": statistics.median(values)})
    return parts


def plot(a: Side, b: Side, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 4))
    for ax, m in zip(axes, METRICS, strict=True):
        for side, style in ((a, "-"), (b, "--")):
            steps = sorted(s for s in side.rows if side.rows[s].get(m) is not None)
            ax.plot(steps, [side.rows[s][m] for s in steps], style, label=side.label)
        ax.set_xlabel("step")
        ax.set_ylabel(m)
        ax.set_title(m)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
