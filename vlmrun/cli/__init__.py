"""The `vlmrun` command line. Parses, calls one function of a layer below, prints. No logic.

Imports of heavy libraries happen inside the commands, so `vlmrun --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from vlmrun.cli.data import data_app
from vlmrun.cli.exits import run
from vlmrun.cli.output import JsonOpt, SetOpt, print_json, print_result

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
app.add_typer(data_app, name="data")


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
        print_json(result.summary())
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
        help="allow --set parallel.dp=N (and parallel.tp, parallel.pp): keep model, optimizer, LR schedule and "
        "step counters (resharded), lose the loaders' positions and the ranks' RNG streams (the data order "
        "starts over)",
    ),
    json_out: bool = JsonOpt,
):
    """Continue an ended run from its newest complete checkpoint (a new attempt in the same run dir).

    \b
    --set may change only what leaves the sample stream and placement as they are (the resume says
    what it changed, and job.json's new attempt lists it under resumed_with):
      train.max_steps, train.epochs, train.val_period, train.val_samples, train.stop_after,
      checkpoint.save_period, checkpoint.keep, checkpoint.requeue, checkpoint.async_save,
      checkpoint.dir (a folder of this run's own checkpoints: moved, or copied with a copied run dir),
      cluster.*, logger.*, data.check_at_submit,
      generation.refit_bucket_mb, generation.release_weights (memory only: no number changes),
      data.on_bad_sample, data.error_tolerance (recovery: a run stopped by a sample it cannot train
      on continues with --set data.on_bad_sample=drop: that sample is skipped and counted in
      dropped_samples, every sample before it was trained; one stopped by too many bad samples, with
      a higher data.error_tolerance);
      parallel.tp, parallel.pp (model.backend megatron, same parallel.dp: the checkpoint is read into
      the new tp x pp, and the data order carries on).
    A change of what defines the run (batch sizes, layout, seed, data and how it is read, sequence
    length, loop, algorithm, model), by --set or by editing recipe.yaml, is refused as
    `field: old -> new`; so is data.num_workers (another worker count is another sample order). A
    completed run says so and exits 0. With --restart-data-order, parallel.dp may change too (and the
    cluster with it), the data order starting over.

    \b
    Example: vlmrun resume runs/tiny-clevr-cpu-20261130-101500 --set train.max_steps=400 --wait
    Example: vlmrun resume runs/tiny-clevr-cpu-20261130-101500 --set data.on_bad_sample=drop --wait
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
        print_json(result.summary())
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
        print_json(result)
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
    print_json(result) if json_out else typer.echo(_one_line(result))


@app.command(no_args_is_help=True)
def requeue(target: str = typer.Argument(..., help="job id or run directory"), json_out: bool = JsonOpt):
    """Ask a running job to checkpoint at the next step boundary and requeue itself now (sends USR2).

    Example: vlmrun requeue 1234
    """
    from vlmrun.launch.control import requeue

    result = requeue(target)
    print_json(result) if json_out else typer.echo(_one_line(result))


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
    print_result(result, json_out, "print_comparison")
    raise typer.Exit(0 if result["verdict"] == "match" else 1)


@app.command(no_args_is_help=True)
def export(
    run_dir: Path = typer.Argument(..., help="run directory with checkpoints"),
    out: Path = typer.Argument(..., help="new folder for the Hugging Face model (must not exist, or be empty)"),
    step: int | None = typer.Option(
        None, "--step", min=1, help="checkpoint step (default: the newest one that verifies)"
    ),
    adapter: bool = typer.Option(
        False, "--adapter", help="a LoRA run's adapters as a peft adapter directory (default: merged into the model)"
    ),
    json_out: bool = JsonOpt,
):
    """Write a checkpoint of a run as a Hugging Face model directory (config, safetensors weights, processor,
    tokenizer, chat template) that AutoModelForImageTextToText.from_pretrained loads; a recipe can start
    from it with --set model.path=OUT --set model.tiny=false. A LoRA run's export is the base merged with
    its adapters, or with --adapter the adapters alone, which peft's PeftModel.from_pretrained loads onto the base.

    Example: vlmrun export runs/tiny-clevr-cpu-20261130-101500 --step 200 exports/tiny-clevr-step200
    """
    from vlmrun.launch.export import export_checkpoint

    result = export_checkpoint(run_dir, out, step=step, adapter=adapter)
    for line in result.skipped:  # a newer checkpoint was damaged: never pass it over in silence
        typer.echo(f"warning: {line}; exported step {result.step}, the newest that verifies", err=True)
    if json_out:
        print_json(result.summary())
    else:
        typer.echo(f"exported step {result.step} to {result.out} ({len(result.files)} files)")


@app.command("eval", no_args_is_help=True)
def eval_(
    target: Path = typer.Argument(..., help="a run directory (its checkpoint) or a model directory (e.g. an export)"),
    step: int | None = typer.Option(
        None, "--step", min=1, help="a run's checkpoint step (default: the newest that verifies)"
    ),
    recipe: Path | None = typer.Option(
        None, "--recipe", help="for a model directory not written by `vlmrun export`: the recipe to evaluate with"
    ),
    set_: list[str] | None = SetOpt,
    data: Path | None = typer.Option(None, "--data", help="another Energon data set (default: the recipe's data.path)"),
    split: str | None = typer.Option(None, "--split", help="the split to score (default: the recipe's data.val_split)"),
    samples: int | None = typer.Option(None, "--samples", min=1, help="samples to score (default: train.val_samples)"),
    against: Path | None = typer.Option(
        None, "--against", help="a second TARGET, scored on the same data, and the differences"
    ),
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads; 1 gives a CPU run's own numbers bit for bit"),
    json_out: bool = JsonOpt,
):
    """Score a checkpoint or a model as the run's own validation does: NLL over the answers' tokens, greedy
    answers' exact-match accuracy (and per question template), their reward by the recipe's reward terms.

    For a run's checkpoint at a step where the run validated, the numbers equal that step's metrics row
    (the result says so: matches_run_row); an export of it gives the same numbers.

    \b
    Examples:
      vlmrun eval runs/tiny-clevr-cpu-20261130-101500 --step 200 --json
      vlmrun eval exports/tiny-clevr-step200 --data data/my-set --samples 256
      vlmrun eval runs/a --against runs/b
    """
    from vlmrun.launch.eval import compare_evals, eval_target

    def one(path: Path, **more) -> dict:
        return eval_target(
            path,
            recipe_path=recipe,
            overrides=set_ or [],
            data=data,
            split=split,
            samples=samples,
            threads=threads,
            **more,
        )

    result = one(target, step=step)
    if against is not None:
        result = compare_evals(result, one(against))
    print_result(result, json_out, "print_eval")


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
    print_result(result, json_out, "print_bench")


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
    print_result(
        run_bench_plane(samples=samples, rows=rows, dim=dim, repeats=repeats, adapters=names),
        json_out,
        "print_plane_bench",
    )


def main() -> None:
    """Console entry point (`vlmrun`, `python -m vlmrun.cli`): exits.py turns every outcome into an exit
    code, and with `--json` every error into one JSON object on stdout. The collector is off while the
    command imports and sets up (vlmrun/startup.py)."""
    from vlmrun.startup import pause_for_command

    pause_for_command()
    run(app)
