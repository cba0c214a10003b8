"""Tables for people (rich). Programs read the `--json` output instead."""

from __future__ import annotations

from pathlib import Path


def _console():
    from rich.console import Console

    return Console()


def print_clevr_summary(summary, out: Path) -> None:
    from rich.table import Table

    data = summary.to_json()
    console = _console()
    console.print(f"wrote {out}")
    for split, s in data["splits"].items():
        console.print(f"{split}: {s['samples']} samples; majority answer {s['majority_answer']!r}, "
                      f"majority-class baseline accuracy {s['majority_accuracy']:.3f}")
        table = Table()
        table.add_column("answer")
        table.add_column("count", justify="right")
        table.add_column("share", justify="right")
        for answer, count in s["answers"].items():
            table.add_row(answer, str(count), f"{count / s['samples']:.3f}")
        console.print(table)


def print_comparison(result: dict) -> None:
    from rich.table import Table

    console = _console()
    labels = list(result["runs"])
    table = Table(title=f"{labels[0]} vs {labels[1]}: {result['steps_compared']} steps compared")
    table.add_column("metric")
    table.add_column("max abs diff", justify="right")
    table.add_column("max rel diff", justify="right")
    for m, d in result["max_abs_diff"].items():
        table.add_row(m, f"{d:.3e}", f"{result['max_rel_diff'][m]:.3e}")
    table.add_row("sample ids", "identical" if result["sample_ids_identical"] else
                  f"differ from step {result['first_sample_id_mismatch']}", "")
    console.print(table)
    perf = Table(title="throughput and memory")
    for col in ("run", "samples/s", "tokens/s", "step time s", "peak RSS MB"):
        perf.add_column(col, justify="right" if col != "run" else "left")
    for label in labels:
        t = result["throughput"][label]
        perf.add_row(label, str(t["samples_per_s"]), str(t["tokens_per_s"]), str(t["step_time_s"]),
                     str(result["peak_rss_mb"][label]))
    console.print(perf)
    if result.get("plot"):
        console.print(f"plot: {result['plot']}")
    verdict = result["verdict"]
    console.print(f"verdict: [bold {'green' if verdict == 'match' else 'red'}]{verdict}[/] (rtol {result['rtol']})")
