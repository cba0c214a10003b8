"""The `vlmrun` command line. Parses, calls one function of a layer below, prints. No logic.

Imports of heavy libraries happen inside the commands, so `vlmrun --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from vlmrun.cli.exits import run
from vlmrun.errors import InputError

app = typer.Typer(
    name="vlmrun",
    help=(
        "Train vision-language models on SLURM: SFT on Ray with Megatron-Energon data, exact checkpoints, "
        "and jobs that requeue themselves.\n\n"
        "Quick start (CPU, no SLURM): vlmrun submit recipes/tiny-clevr-cpu.yaml --cluster local --wait\n\n"
        "Exit codes: 0 success, 1 the thing checked failed (diverged comparison, failed job), "
        "2 bad input (recipe, arguments), 3 stopped at a checkpoint (resumable)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
data_app = typer.Typer(
    help="Make data sets: a synthetic one (clevr), or yours converted (prepare). "
    "Example: vlmrun data clevr data/clevr --train 1024 --val 128",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")

SetOpt = typer.Option(None, "--set", help="override a recipe field, e.g. --set train.max_steps=400 (repeatable)")
JsonOpt = typer.Option(False, "--json", help="print one JSON object for scripts instead of text")


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _print_result(result: dict, json_out: bool, table: str) -> None:
    """`result` as one JSON object with --json, else as the table `vlmrun.observe.tables.<table>` prints."""
    if json_out:
        _print_json(result)
    else:
        from vlmrun.observe import tables

        getattr(tables, table)(result)


@app.command(no_args_is_help=True)
def submit(
    recipe: Path = typer.Argument(..., help="recipe YAML, e.g. recipes/tiny-clevr-cpu.yaml"),
    set_: list[str] | None = SetOpt,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate and print the resolved recipe and its memory estimate; start nothing"
    ),
    cluster: str = typer.Option("auto", "--cluster", help="auto (slurm when sbatch exists, else local), slurm, local"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="run directory (default runs/<name>-<timestamp>)"),
    wait: bool = typer.Option(False, "--wait", help="stay attached: stream progress, exit with the job's outcome"),
    json_out: bool = JsonOpt,
):
    """Validate a recipe and start a run.

    Example: vlmrun submit recipes/tiny-clevr-cpu.yaml --cluster local --set train.max_steps=50 --wait
    """
    from vlmrun.launch.submit import submit_run

    result = submit_run(
        recipe,
        set_ or [],
        cluster=cluster,
        run_dir=run_dir,
        dry_run=dry_run,
        wait=wait,
        echo=None if json_out else typer.echo,
    )
    if json_out:
        _print_json(result.summary())
    elif dry_run:
        typer.echo(result.rendered)
        if result.memory is not None:
            typer.echo("# --- memory ---\n" + "\n".join(f"# {line}" for line in result.memory.report_lines()))
        if result.script:
            typer.echo(f"# --- sbatch script ---\n{result.script}")
        typer.echo(f"# dry run: nothing started or submitted; run dir would be {result.run_dir}", err=True)
    raise typer.Exit(result.exit_code)


@app.command(no_args_is_help=True)
def resume(
    target: str = typer.Argument(..., help="run directory of an ended run"),
    set_: list[str] | None = SetOpt,
    wait: bool = typer.Option(False, "--wait", help="stay attached: stream progress, exit with the job's outcome"),
    restart_data_order: bool = typer.Option(
        False,
        "--restart-data-order",
        help="allow --set parallel.dp=N: keep model, optimizer, LR schedule and step counters (resharded), "
        "lose the loaders' positions and the ranks' RNG streams (the data order starts over)",
    ),
    json_out: bool = JsonOpt,
):
    """Continue an ended run from its newest complete checkpoint (a new attempt in the same run dir).

    Only fields that leave the sample stream and placement unchanged may be overridden
    (train.max_steps, train.epochs, train.val_*, checkpoint.*, cluster.*, logger.*); a change of what
    defines the run (batch sizes, layout, seed, data, sequence length, loop, algorithm, model), by --set
    or by editing recipe.yaml, is refused as `field: old -> new`. A completed run says so and exits 0.
    With --restart-data-order, parallel.dp may change too (and the cluster with it).

    Example: vlmrun resume runs/tiny-clevr-cpu-20261130-101500 --set train.max_steps=400 --wait
    Example: vlmrun resume 1234 --restart-data-order --set parallel.dp=1 --set cluster.gpus_per_node=1
    """
    from vlmrun.launch.resume import resume_run

    result = resume_run(
        target,
        set_ or [],
        wait=wait,
        restart_data_order=restart_data_order,
        echo=None if json_out else typer.echo,
    )
    if json_out:
        _print_json(result.summary())
    raise typer.Exit(result.exit_code)


@app.command()
def status(
    target: str | None = typer.Argument(None, help="job id or run directory; default: every job vlmrun knows"),
    json_out: bool = JsonOpt,
):
    """State of a run: SLURM's view (squeue, sacct when it has accounting), lineage, restarts, last step and loss.

    Example: vlmrun status 1234 --json
    """
    from vlmrun.launch.status import status

    result = status(target)
    if json_out:
        _print_json(result)
    else:
        from vlmrun.observe.tables import print_status

        print_status(result)


@app.command(no_args_is_help=True)
def logs(
    target: str = typer.Argument(..., help="job id or run directory"),
    attempt: int | None = typer.Option(None, "--attempt", min=0, help="only this attempt (restart count)"),
    follow: bool = typer.Option(False, "-f", "--follow", help="keep printing as the job writes"),
):
    """Print the driver log of a job (every attempt, or one with --attempt).

    Example: vlmrun logs 1234 -f
    """
    from vlmrun.launch.logs import logs

    for line in logs(target, attempt=attempt, follow=follow):
        typer.echo(line.rstrip("\n"))


@app.command(no_args_is_help=True)
def cancel(target: str = typer.Argument(..., help="job id or run directory"), json_out: bool = JsonOpt):
    """Cancel a job: it checkpoints after the step in flight (killed if it takes too long), no requeue.

    Waits until the job has ended and prints the state it ended in (CANCELLED, or COMPLETED/FAILED
    when it ended first, KILLED when it had to be killed). The run can be resumed from its last checkpoint.

    Example: vlmrun cancel 1234
    """
    from vlmrun.launch.control import cancel

    result = cancel(target)
    _print_json(result) if json_out else typer.echo(_one_line(result))


@app.command(no_args_is_help=True)
def requeue(target: str = typer.Argument(..., help="job id or run directory"), json_out: bool = JsonOpt):
    """Ask a running job to checkpoint at the next step boundary and requeue itself now (sends USR2).

    Example: vlmrun requeue 1234
    """
    from vlmrun.launch.control import requeue

    result = requeue(target)
    _print_json(result) if json_out else typer.echo(_one_line(result))


def _one_line(result: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in result.items())


@app.command(no_args_is_help=True)
def compare(
    a: str = typer.Argument(..., help="v1 (with --recipe), or a run directory"),
    b: str = typer.Argument(..., help="v2 (with --recipe), or a run directory"),
    recipe: Path | None = typer.Option(None, "--recipe", help="recipe to run through both loops"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="steps of each loop run (sets train.max_steps)"),
    set_: list[str] | None = SetOpt,
    out: Path | None = typer.Option(
        None, "--out", help="folder for the runs and the plot (default runs/compare-<time>)"
    ),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="relative tolerance per metric; 0 = bitwise identical"),
    rounds: int = typer.Option(2, "--rounds", min=1, help="v1 v2: throughput ratios to take (rounds + 1 parts)"),
    json_out: bool = JsonOpt,
):
    """Compare loss and grad_norm of two runs step by step, with a plot and a verdict.

    Exit 0 when every compared metric is within --rtol and the sample ids match, 1 when not. With v1 v2
    the runs take turns (v1, v2, v1, ...: each part ends with the run's own checkpoint and the next
    resumes it), so the throughput ratio is the median over --rounds neighbouring parts, with its spread.

    Examples:
      vlmrun compare v1 v2 --recipe recipes/tiny-clevr-cpu.yaml --steps 30
      vlmrun compare runs/a runs/b --rtol 1e-6 --json
    """
    from vlmrun.launch.compare import compare_targets

    echo = None if json_out else typer.echo
    result = compare_targets(
        a, b, recipe=recipe, steps=steps, overrides=set_ or [], out=out, rtol=rtol, rounds=rounds, echo=echo
    )
    _print_result(result, json_out, "print_comparison")
    raise typer.Exit(0 if result["verdict"] == "match" else 1)


@app.command(no_args_is_help=True)
def export(
    run_dir: Path = typer.Argument(..., help="run directory with checkpoints"),
    out: Path = typer.Argument(..., help="new folder for the Hugging Face model (must not exist, or be empty)"),
    step: int | None = typer.Option(
        None, "--step", min=1, help="checkpoint step (default: the newest one that verifies)"
    ),
    json_out: bool = JsonOpt,
):
    """Write a checkpoint of a run as a Hugging Face model directory (config, safetensors weights, processor,
    tokenizer, chat template) that AutoModelForImageTextToText.from_pretrained loads; a recipe can start
    from it with --set model.path=OUT --set model.tiny=false.

    Example: vlmrun export runs/tiny-clevr-cpu-20261130-101500 --step 200 exports/tiny-clevr-step200
    """
    from vlmrun.launch.export import export_checkpoint

    result = export_checkpoint(run_dir, out, step=step)
    for line in result.skipped:  # a newer checkpoint was damaged: never pass it over in silence
        typer.echo(f"warning: {line}; exported step {result.step}, the newest that verifies", err=True)
    if json_out:
        _print_json(result.summary())
    else:
        typer.echo(f"exported step {result.step} to {result.out} ({len(result.files)} files)")


@app.command("bench-loader")
def bench_loader(
    recipe: Path = typer.Argument(Path("recipes/tiny-clevr-cpu.yaml"), help="recipe whose data path to measure"),
    workers: str = typer.Option("0,1,2", "--workers", help="comma-separated loader worker counts to try"),
    batches: int = typer.Option(
        600, "--batches", min=1, help="measured micro-batches per row (chunks of 60, in rounds)"
    ),
    image_size: int | None = typer.Option(
        None, "--image-size", min=32, max=1024, help="image side of the (generated) data set; default 224"
    ),
    set_: list[str] | None = SetOpt,
    json_out: bool = JsonOpt,
):
    """Loader throughput: the Energon loader vs a plain WebDataset + DataLoader reference vs the
    decode-and-encode limit, side by side on the same shards; each ratio is the median over rounds.

    Example: vlmrun bench-loader recipes/tiny-clevr-cpu.yaml --workers 0,1,2 --json
    """
    from vlmrun.bench.loader import bench_recipe

    result = bench_recipe(recipe, set_ or [], workers=workers, batches=batches, image_size=image_size, bar=not json_out)
    _print_result(result, json_out, "print_bench")


@app.command("bench-plane")
def bench_plane(
    samples: int = typer.Option(8, "--samples", min=1, help="samples in the batch (0-2 images each)"),
    rows: int = typer.Option(1024, "--rows", min=32, help="patch rows per image"),
    dim: int = typer.Option(1176, "--dim", min=1, help="values per patch row (Qwen2.5-VL: 1176)"),
    repeats: int = typer.Option(5, "--repeats", min=1, help="rounds; rates and ratios are medians over them"),
    adapters: str = typer.Option("local,simple,mooncake", "--adapters", help="comma-separated subset"),
    json_out: bool = JsonOpt,
):
    """Data-plane throughput: the wire's encode + decode against a plain copy of the same bytes, and
    put/get MB/s of each adapter (local; TransferQueue simple and mooncake on a private Ray).

    Example: vlmrun bench-plane --adapters local,simple --repeats 5 --json
    """
    from vlmrun.bench.plane import run_bench_plane

    names = [a.strip() for a in adapters.split(",") if a.strip()]
    _print_result(
        run_bench_plane(samples=samples, rows=rows, dim=dim, repeats=repeats, adapters=names),
        json_out,
        "print_plane_bench",
    )


@data_app.command("clevr", no_args_is_help=True)
def data_clevr(
    out: Path = typer.Argument(..., help="output directory (Energon-prepared WebDataset shards)"),
    train: int = typer.Option(1024, "--train", min=1, help="training samples"),
    val: int = typer.Option(128, "--val", min=1, help="validation samples"),
    image_size: int = typer.Option(112, "--image-size", min=32, max=1024, help="square image side in pixels"),
    seed: int = typer.Option(0, "--seed", help="same seed, same bytes"),
    image_format: str = typer.Option("jpg", "--format", help="jpg or png"),
    json_out: bool = JsonOpt,
):
    """Draw a synthetic CLEVR-style counting set with PIL and prepare it for Energon.

    Example: vlmrun data clevr data/clevr-224 --train 2048 --val 256 --image-size 224 --seed 0
    """
    from vlmrun.datasets.clevr import generate_clevr
    from vlmrun.observe.progress import progress_bar

    if image_format not in ("jpg", "png"):
        raise InputError("--format", image_format, "use jpg or png")
    with progress_bar("drawing scenes", enabled=not json_out) as progress:
        summary = generate_clevr(
            out, train=train, val=val, image_size=image_size, seed=seed, image_format=image_format, progress=progress
        )
    if json_out:
        _print_json(summary.to_json())
    else:
        from vlmrun.observe.tables import print_clevr_summary

        print_clevr_summary(summary, out)


@data_app.command("prepare", no_args_is_help=True)
def data_prepare(
    src: Path = typer.Argument(
        ...,
        help="a LLaVA .json or .jsonl file, a .parquet file or folder of them, or a folder of WebDataset .tar shards",
    ),
    out: Path = typer.Argument(..., help="new folder for the Energon data set (missing or empty; see --overwrite)"),
    source_format: str = typer.Option(..., "--format", help="what SRC is: llava, parquet or webdataset"),
    image_root: Path | None = typer.Option(
        None, "--image-root", help="folder that relative image paths start from (default: SRC's folder)"
    ),
    image_column: str | None = typer.Option(
        None,
        "--image-column",
        help="parquet: the images (bytes, {bytes, path} as Hugging Face datasets writes them, a path, or a list)",
    ),
    messages_column: str | None = typer.Option(
        None, "--messages-column", help="parquet: the conversation, a list of {role, content} or {from, value}"
    ),
    question_column: str | None = typer.Option(
        None, "--question-column", help="parquet: the question (instead of --messages-column)"
    ),
    answer_column: str | None = typer.Option(None, "--answer-column", help="parquet: the answer to --question-column"),
    id_column: str | None = typer.Option(None, "--id-column", help="parquet: the row id (default: its position)"),
    fields: list[str] | None = typer.Option(
        None,
        "--field",
        help="webdataset: NAME=EXT, the member a field is in: image=jpg (or jpg,png: each one present), "
        "question=txt and answer=answer.txt, or conversations=json (LLaVA turns); id=EXT (repeatable)",
    ),
    split_column: str | None = typer.Option(
        None, "--split-column", help="the field or column (train or val) that splits the rows, instead of --val-ratio"
    ),
    val_ratio: float | None = typer.Option(
        None, "--val-ratio", help="share of rows for val, chosen by a hash of the row id and --seed (default 0.05)"
    ),
    seed: int = typer.Option(0, "--seed", help="seed of the --val-ratio split: same seed, same split"),
    max_bad_rows: str = typer.Option(
        "16",
        "--max-bad-rows",
        help="rows that may be skipped (each reason's first rows are named): a count, or a fraction of the rows "
        "read (0.01 or 1%); one more and nothing is written (exit 2)",
    ),
    samples_per_shard: int = typer.Option(1024, "--samples-per-shard", min=1, help="samples per .tar shard"),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="replace a non-empty OUT (the new set is written beside it and swapped in at the end)",
    ),
    json_out: bool = JsonOpt,
):
    """Convert your multimodal conversations into an Energon data set that a recipe's data.path names.

    LLaVA rows are {"id", "image": a path or a list of paths (none: text only), "conversations": [{"from":
    "human" | "gpt" | "system", "value"}]} with one <image> placeholder per image in the human text (a row
    without placeholders gets its images before the first human text). Images are stored as they are,
    after a check that they decode; a URL is never downloaded. Rows that cannot be used (missing or
    undecodable image, URL, no gpt answer, placeholders that do not match the images, empty text) are
    skipped, counted and named, up to --max-bad-rows. Train with: vlmrun submit recipes/tiny-clevr-cpu.yaml
    --set data.path=OUT

    \b
    Examples:
      vlmrun data prepare data/llava/chat.json data/my-set --format llava --image-root data/llava/images
      vlmrun data prepare data/vqa.parquet data/vqa-set --format parquet --image-column image --question-column question --answer-column answer
      vlmrun data prepare data/shards data/wds-set --format webdataset --field image=jpg --field question=txt --field answer=answer.txt
    """
    from vlmrun.datasets.user_data import BadRowBudget, prepare_user_data
    from vlmrun.datasets.user_readers import SourceSpec, parse_fields
    from vlmrun.observe.progress import progress_bar

    spec = SourceSpec(
        format=source_format,
        path=src,
        image_root=image_root,
        image_column=image_column,
        messages_column=messages_column,
        question_column=question_column,
        answer_column=answer_column,
        id_column=id_column,
        fields=parse_fields(fields or []),
        split_column=split_column,
    )
    budget = BadRowBudget.parse(max_bad_rows)
    with progress_bar("converting rows", enabled=not json_out) as progress:
        summary = prepare_user_data(
            spec,
            out,
            val_ratio=val_ratio,
            seed=seed,
            budget=budget,
            samples_per_shard=samples_per_shard,
            overwrite=overwrite,
            progress=progress,
        )
    _print_result(summary.to_json(), json_out, "print_prepare_summary")


def main() -> None:
    """Console entry point (`vlmrun`, `python -m vlmrun.cli`): exits.py turns every outcome into an exit
    code, and with `--json` every error into one JSON object on stdout."""
    run(app)
