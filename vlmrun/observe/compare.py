"""Compare two runs step by step: max abs/rel differences per metric, sample ids, throughput, a plot, a verdict."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.run.metrics import history

METRICS = ("loss", "grad_norm")


@dataclass
class Side:
    label: str
    run_dir: Path
    rows: dict[int, dict]


def load_side(label: str, run_dir: Path, metrics_file: str = "metrics.jsonl") -> Side:
    """The rows of one run; InputError naming the file when it is missing, empty or damaged (run/metrics.py)."""
    path = Path(run_dir) / metrics_file
    if not path.is_file():
        raise InputError("RUN", str(run_dir), message=f"{run_dir}: no {metrics_file} (is it a vlmrun run directory?)")
    rows = history(path)
    if not rows:
        raise InputError("RUN", str(run_dir), message=f"{path}: no step rows yet")
    return Side(label, Path(run_dir), rows)


def compare_sides(a: Side, b: Side, *, rtol: float = 0.0, out_dir: Path | None = None) -> dict:
    """The comparison as a JSON-able dict; `verdict` is "match" when every metric is within `rtol`."""
    steps = sorted(set(a.rows) & set(b.rows))
    only = sorted(set(a.rows) ^ set(b.rows))
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
    match = bool(steps) and not only and not first_diff and not id_mismatch
    result = {
        "verdict": "match" if match else "diverged",
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
        "peak_rss_mb": {s.label: max((r.get("peak_rss_mb") or 0) for r in s.rows.values()) for s in (a, b)},
        "plot": None,
    }
    if out_dir is not None:
        result["plot"] = str(plot(a, b, Path(out_dir) / f"compare-{a.label}-vs-{b.label}.png"))
    return result


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
