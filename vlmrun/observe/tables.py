"""Tables for people (rich). Programs read the `--json` output instead."""

from __future__ import annotations

from pathlib import Path

from vlmrun.observe.ratios import describe_spread


def _console():
    from rich.console import Console

    return Console()


def print_clevr_summary(summary, out: Path) -> None:
    from rich.table import Table

    data = summary.to_json()
    console = _console()
    console.print(f"wrote {out}")
    for split, s in data["splits"].items():
        console.print(
            f"{split}: {s['samples']} samples; majority answer {s['majority_answer']!r}, "
            f"majority-class baseline accuracy {s['majority_accuracy']:.3f}"
        )
        table = Table()
        table.add_column("answer")
        table.add_column("count", justify="right")
        table.add_column("share", justify="right")
        for answer, count in s["answers"].items():
            table.add_row(answer, str(count), f"{count / s['samples']:.3f}")
        console.print(table)


def print_prepare_summary(result: dict) -> None:
    """The summary of `vlmrun data prepare` (`PrepareSummary.to_json`): counts, then bad rows by reason."""
    from rich.table import Table

    console = _console()
    console.print(f"wrote {result['path']} from {result['source']} ({result['format']})")
    counts = Table()
    counts.add_column("rows read", justify="right")
    for col in ("train", "val", "images", "text-only", "bad rows"):
        counts.add_column(col, justify="right")
    counts.add_row(
        *(str(result[k]) for k in ("rows_read", "train", "val", "images", "text_only")),
        f"{result['bad_rows']} (at most {result['max_bad_rows']})",
    )
    console.print(counts)
    if result["bad_rows_by_reason"]:
        bad = Table(title="rows skipped")
        for col in ("reason", "rows", "first rows", "first problem"):
            bad.add_column(col, justify="right" if col == "rows" else "left")
        for reason, info in result["bad_rows_by_reason"].items():
            bad.add_row(reason, str(info["count"]), ", ".join(info["rows"]), info["first"])
        console.print(bad)
    if not result["val"]:
        console.print("no val split: train with --set train.val_samples=0, or prepare again with --val-ratio")
    console.print(f"train on it: vlmrun submit RECIPE --set data.path={result['path']}")


def print_data_check(result: dict) -> None:
    """The result of `vlmrun data check` (`DataCheck.to_json`): counts per split, the first samples of each
    kind, then the verdict."""
    from rich.table import Table

    console = _console()
    console.print(
        f"{result['path']} against family {result['family']}, data.max_seq_len={result['max_seq_len']}, "
        f"data.on_bad_sample={result['on_bad_sample']}, data.error_tolerance={result['error_tolerance']} "
        f"x {result['loader_shards']} loader shard(s)"
    )
    kinds = sorted({kind for s in result["splits"] for kind in s["bad"]})
    counts = Table()
    for col in ("split", "samples", "ok", "truncated", *kinds):
        counts.add_column(col, justify="left" if col == "split" else "right")
    for s in result["splits"]:
        counts.add_row(
            s["split"], str(s["samples"]), str(s["ok"]), str(s["truncated"]), *(str(s["bad"].get(k, 0)) for k in kinds)
        )
    console.print(counts)
    for s in result["splits"]:
        for kind, named in s["first"].items():
            console.print(f"{s['split']}: {kind}: " + "; ".join(named))
    for line in result["warnings"]:
        console.print(f"warning: {line}")
    for line in result["problems"]:
        console.print(f"would stop the run: {line}")
    if result["ok"]:
        console.print("the run would not stop on these samples")


def print_eval(result: dict) -> None:
    """`vlmrun eval` (`launch/eval.py`): one target's scores, or two side by side with B - A."""
    from rich.table import Table

    pair = [result["a"], result["b"]] if "a" in result else [result]
    keys = ("val_loss", "val_accuracy", "val_majority_baseline", "val_samples", "val_samples_requested", "val_tokens")
    table = Table(title=f"{pair[0]['split']} of {pair[0]['data']}")
    table.add_column("")
    for r in pair:
        table.add_column(r["target"] + (f" (step {r['step']})" if r.get("step") else ""), justify="right")
    if len(pair) == 2:
        table.add_column("B - A", justify="right")
    for k in keys:
        table.add_row(k, *(_num(r[k]) for r in pair), *([_num(result["delta"].get(k))] if len(pair) == 2 else []))
    table.add_row(
        "reward",
        *(_num(r["reward"]["mean"]) for r in pair),
        *([_num(result["delta"].get("reward"))] if len(pair) == 2 else []),
    )
    templates = sorted({t for r in pair for t in r["templates"]})
    for t in templates:
        table.add_row(
            f"accuracy: {t}",
            *(_num(r["templates"].get(t, {}).get("accuracy")) for r in pair),
            *([""] if len(pair) == 2 else []),
        )
    console = _console()
    console.print(table)
    for r in pair:
        if r.get("matches_run_row") is not None:
            same = "equal" if r["matches_run_row"] else "DIFFER FROM"
            console.print(f"{r['target']}: these numbers {same} the run's own validation row of step {r['step']}")


def _num(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


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
    table.add_row(
        "sample ids",
        "identical" if result["sample_ids_identical"] else f"differ from step {result['first_sample_id_mismatch']}",
        "",
    )
    console.print(table)
    perf = Table(title="throughput and memory")
    for col in ("run", "samples/s", "tokens/s", "step time s", "peak RSS MB"):
        perf.add_column(col, justify="right" if col != "run" else "left")
    for label in labels:
        t = result["throughput"][label]
        perf.add_row(
            label,
            str(t["samples_per_s"]),
            str(t["tokens_per_s"]),
            str(t["step_time_s"]),
            str(result["peak_rss_mb"][label]),
        )
    console.print(perf)
    ratio = result["throughput_ratio"]
    console.print(f"{ratio['runs']} {ratio['of'].replace('_per_s', '/s')}: {describe_spread(ratio)}")
    if result.get("plot"):
        console.print(f"plot: {result['plot']}")
    for line in result.get("skipped", []):
        console.print(f"warning: {line}", markup=False)
    from rich.markup import escape

    verdict = result["verdict"]
    why = f": {'; '.join(result['reasons'])}" if result.get("reasons") else ""
    console.print(
        f"verdict: [bold {'green' if verdict == 'match' else 'red'}]{verdict}[/] (rtol {result['rtol']}){escape(why)}"
    )


def print_bench(result: dict) -> None:
    from rich.table import Table

    console = _console()
    table = Table(
        title=f"bench-loader: {result['dataset']} ({result['image_size']} px, "
        f"micro-batch {result['micro_batch_size']}, {result['batches']} batches per row)"
    )
    for col in (
        "loader",
        "workers",
        "samples/s",
        "chunks IQR",
        "MB/s",
        "p50 ms",
        "p95 ms",
        "peak RSS MB",
        "USS/worker MB",
    ):
        table.add_column(col, justify="left" if col == "loader" else "right")
    for r in result["results"]:
        iqr = r.get("samples_per_s_iqr")
        uss = r.get("uss_per_worker_mb") or []
        table.add_row(
            r["loader"],
            str(r["num_workers"]),
            f"{r['samples_per_s']:.1f}",
            f"{iqr[0]:.0f}-{iqr[1]:.0f}" if iqr else "-",
            _fmt(r.get("mb_per_s")),
            _fmt(r.get("p50_batch_ms")),
            _fmt(r.get("p95_batch_ms")),
            _fmt(r.get("peak_rss_mb")),
            _fmt(max(uss)) if uss else "-",
        )
    console.print(table)
    target = result.get("target", {})
    for kind in ("reference", "limit"):
        key = f"energon_vs_{kind}"
        console.print(
            f"energon / {kind}: {describe_spread(result['ratio_spread'][key])} (target >= {target.get(key, '-')})"
        )


def print_plane_bench(result: dict) -> None:
    from rich.table import Table

    console = _console()
    wire = result["wire"]
    console.print(
        f"bench-plane: {result['payload_mb']} MB, {result['samples']} samples, {result['images']} images, "
        f"{result['repeats']} rounds"
    )
    console.print(
        f"wire encode+decode {wire['encode_decode_mb_s']} MB/s; plain copy into one buffer "
        f"{wire['plain_copy_one_buffer_mb_s']} MB/s, per tensor {wire['plain_copy_per_tensor_mb_s']} MB/s; "
        f"wire time / one-buffer copy time: {describe_spread(wire['wire_over_one_buffer_copy'])}"
    )
    table = Table()
    for col in ("adapter", "put MB/s", "get MB/s"):
        table.add_column(col, justify="left" if col == "adapter" else "right")
    for name, row in result["adapters"].items():
        if "skipped" in row:
            table.add_row(name, "skipped", row["skipped"])
        else:
            table.add_row(name, _fmt(row["put_mb_s"]), _fmt(row["get_mb_s"]))
    console.print(table)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def print_status(result: dict) -> None:
    from rich.table import Table

    rows = result.get("jobs", [result])
    table = Table()
    for col in ("job", "state", "restarts", "last step", "loss", "run dir"):
        table.add_column(col)
    for r in rows:
        loss = r.get("loss")
        table.add_row(
            str(r.get("job_id") or "-"),
            str(r.get("state") or "-"),
            str(r.get("restarts", "-")),
            str(r.get("last_step") if r.get("last_step") is not None else "-"),
            f"{loss:.4f}" if isinstance(loss, float) else "-",
            str(r.get("run_dir", "-")),
        )
    _console().print(table)
    if len(rows) == 1 and rows[0].get("reason"):
        _console().print(f"reason: {rows[0]['reason']}")
