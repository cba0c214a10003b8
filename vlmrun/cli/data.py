"""`vlmrun data`: make data sets, a synthetic one (`clevr`) or the user's converted (`prepare`)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import typer

from vlmrun.cli.output import JsonOpt, SetOpt, print_json, print_result
from vlmrun.errors import InputError, StopSignalled


@contextlib.contextmanager
def _stopped_by_signals():
    """SIGINT, SIGTERM and SIGHUP stop the command as Ctrl-C does: what it was writing (a staging folder)
    is removed on the way out, and the CLI exits 128 + the signal's number (cli/exits.py)."""

    def stop(signum, _frame):
        raise StopSignalled(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


data_app = typer.Typer(
    help="Make data sets: a synthetic one (clevr), or yours converted (prepare); check one against a recipe "
    "(check). Example: vlmrun data clevr data/clevr --train 1024 --val 128",
    no_args_is_help=True,
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
    with _stopped_by_signals(), progress_bar("drawing scenes", enabled=not json_out) as progress:
        summary = generate_clevr(
            out, train=train, val=val, image_size=image_size, seed=seed, image_format=image_format, progress=progress
        )
    if json_out:
        print_json(summary.to_json())
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
        None,
        "--image-root",
        help="folder that relative image paths start from and every image path must stay inside (default: SRC's "
        "folder)",
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
    without placeholders gets its images before the first human text); chat rows {"messages": [{"role",
    "content"}], "images"} are read too. Images are stored as they are, after a check that they decode; a
    URL is never downloaded, and a path that leads out of --image-root is never read. Text must be UTF-8
    (no encoding is guessed). Rows that cannot be used (missing or undecodable image, URL, image outside
    --image-root, text that is not UTF-8, no gpt answer, placeholders that do not match the images, empty
    text) are skipped, counted and named, up to --max-bad-rows. Train with: vlmrun submit
    recipes/tiny-clevr-cpu.yaml --set data.path=OUT

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
    with _stopped_by_signals(), progress_bar("converting rows", enabled=not json_out) as progress:
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
    print_result(summary.to_json(), json_out, "print_prepare_summary")


@data_app.command("check", no_args_is_help=True)
def data_check(
    data: Path = typer.Argument(..., help="an Energon data set (e.g. what `vlmrun data prepare` wrote)"),
    recipe: Path = typer.Option(..., "--recipe", help="the recipe that will train on it (its model and data.*)"),
    set_: list[str] | None = SetOpt,
    json_out: bool = JsonOpt,
):
    """Encode every sample the recipe's run would read, as its loader does, and say what the run would do.

    Each sample of the training split (and of the validation split, when train.val_samples > 0) goes
    through the recipe's processor, chat template and task encoder: ok (cut at data.max_seq_len with its
    image and an answer token kept counts as ok, "truncated"), unfit (too_long: a prompt longer than
    data.max_seq_len; media_cut: the cut would fall inside its image; no_label: no answer token;
    media_mismatch: image tokens that do not match its images, e.g. a text that spells <|image_pad|>) or
    corrupt. Unfit samples stop a run under data.on_bad_sample=refuse; under drop they are skipped within
    data.error_tolerance per loader shard. Exit 0 when the run would not stop on them, 1 when it would.
    `vlmrun submit` runs the same check (cached) on a prepared data.path.

    \b
    Examples:
      vlmrun data check data/my-set --recipe recipes/tiny-clevr-cpu.yaml
      vlmrun data check data/my-set --recipe recipes/tiny-clevr-cpu.yaml --set data.max_seq_len=512 --json
    """
    from vlmrun.config.load import load_recipe
    from vlmrun.data.check import check_data, read_splits, write_cache
    from vlmrun.launch.data_check import processor_dir_for
    from vlmrun.observe.progress import progress_bar

    loaded = load_recipe(recipe, [*(set_ or []), f"data.path={data.resolve()}", "data.synthetic=null"])
    if not (data / ".nv-meta").is_dir():
        raise InputError(
            "data",
            str(data),
            message=f"data: {data} is not an Energon data set (no .nv-meta/); make one with `vlmrun data prepare`",
        )
    read_splits(loaded)  # a split it lacks is named before a processor is built
    processor_dir = processor_dir_for(loaded)
    if processor_dir is None:
        raise InputError(
            "model.path",
            loaded.model.path,
            message=f"model.path: {loaded.model.path} has no model on this machine; the check needs its processor",
        )
    with progress_bar("checking samples", enabled=not json_out) as progress:
        result = check_data(loaded, processor_dir=processor_dir, progress=progress)
    write_cache(loaded, processor_dir, result)
    print_result(result.to_json(), json_out, "print_data_check")
    raise typer.Exit(0 if result.ok else 1)
