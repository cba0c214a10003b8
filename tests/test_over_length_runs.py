"""Samples that do not fit data.max_seq_len, through real tiny runs via the CLI (local cluster: real Ray,
Energon and the tiny Qwen2.5-VL), SFT and GRPO. With `data.on_bad_sample: refuse` the run fails with
one line naming the sample, its token count and the limit (exit 2); with `drop` it trains, the rows
count the drops (and the SFT conversations cut) since the run began, across a resume, and no trained
sample is one that did not fit. (That a restored loader shard counts exactly what an uninterrupted one
does, and SFT's refusal: tests/test_data_over_length.py, with real Energon shards.)

On this data set (112 px images) every prompt has 32 or 33 tokens and every conversation 35 or 36:
at a limit of 33 a 33-token prompt leaves no answer token (SFT drops it) and every other SFT sample
is cut after its first answer tokens; at 32 the 33-token prompts do not fit (GRPO drops them).

A run that `refuse` stopped on a sample, after checkpoints, resumes with `--set data.on_bad_sample=drop`
into exactly the numbers of a run that dropped from the start, and says and records what it changed;
the attempt log of a `--wait` run holds every line its console showed (the dropped sample's included).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from data_samples import read_raw_samples
from vlmrun_cli import GRPO, TINY, job, same_history, sealed, sets, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow
SFT, SFT_LIMIT, GRPO_LIMIT = TINY, 33, 32


@pytest.fixture(scope="module")
def data(run_data) -> list[str]:
    """The session's CLEVR set (112 px); two samples in five are dropped: more than the default allows.
    One rank: the drops are the loader shards' own counts, whatever the number of shards."""
    return [*run_data, *sets("train.val_samples=8", "data.error_tolerance=256", "parallel.dp=1")]


def submit(recipe: str, run: Path, data: list[str], *items: str):
    return vlmrun("submit", recipe, "--cluster", "local", "--run-dir", str(run), *data, *sets(*items), "--wait")


def prompt_lengths(run: Path, data_path: str, split: str) -> dict[str, int]:
    """Every sample's prompt length in tokens, with the processor of the run's tiny model."""
    from vlmrun.config.families import family_spec
    from vlmrun.config.load import load_recipe
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import cook_conversation
    from vlmrun.data.loader import load_processor
    from vlmrun.models.source import ensure_model

    recipe = load_recipe(run / "recipe.yaml")
    model = ensure_model(recipe.model, run / "cache", recipe.train.seed)  # the one the run trained (built)
    encoder = ConversationEncoder(load_processor(str(model), "qwen2_5_vl"), family_spec("qwen2_5_vl"), 10**6)
    raw = read_raw_samples(Path(data_path), split)
    return {key: encoder.encode_prompt(cook_conversation(r)).input_ids.numel() for key, r in sorted(raw.items())}


def data_path(data: list[str]) -> str:
    return next(item.split("=", 1)[1] for item in data if item.startswith("data.path="))


def skipped_to_fill(lengths: dict[str, int], fits, wanted: int) -> int:
    """Validation samples skipped, in split order, before `wanted` ones whose prompt length `fits`."""
    skipped = kept = 0
    for n in lengths.values():
        if kept == wanted:
            break
        kept, skipped = (kept + 1, skipped) if fits(n) else (kept, skipped + 1)
    return skipped


def test_refuse_fails_the_run_in_one_line_naming_the_sample(tmp_path, data):
    """(SFT's encoder refuses the same way: tests/test_data_over_length.py; the job's path is one.)"""
    limit = GRPO_LIMIT
    out = submit(GRPO, tmp_path / "run", data, f"data.max_seq_len={limit}", "train.max_steps=3")
    assert out.returncode == 2, out.stderr[-3000:]
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    reason = job["attempts"][-1]["reason"]
    assert job["state"] == "FAILED" and "\n" not in reason
    assert reason.startswith("loader shard ") and ": sample train-" in reason
    assert re.search(rf" \d+ tokens[^;]*, more than data.max_seq_len={limit}\b", reason), reason
    assert "data.on_bad_sample=drop" in reason
    assert reason in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def sft_drop(tmp_path_factory, data) -> Path:
    """An SFT run that drops what does not fit: 3 steps, then resumed to 6 (checkpoints every 2 steps)."""
    run = tmp_path_factory.mktemp("sft-drop") / "run"
    drop = (f"data.max_seq_len={SFT_LIMIT}", "data.on_bad_sample=drop", "checkpoint.save_period=2")
    out = submit(SFT, run, data, *drop, "train.max_steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    out = vlmrun("resume", str(run), "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_sft_drop_trains_counts_and_never_trains_a_sample_that_does_not_fit(sft_drop, data):
    run = sft_drop
    rows = history(run / "metrics.jsonl")
    train = prompt_lengths(run, data_path(data), "train")
    trained = {k for row in rows.values() for k in row["sample_ids"]}
    assert trained and all(train[k] < SFT_LIMIT for k in trained)  # room for an answer token after the prompt
    drops = [rows[s]["dropped_samples"] for s in sorted(rows)]
    assert drops == sorted(drops) and drops[-1] > 0  # counted since the run began, across the resume
    assert (
        rows[3]["attempt"] == 0 and rows[4]["attempt"] == 1 and rows[6]["dropped_samples"] > rows[3]["dropped_samples"]
    )
    # every conversation here is longer than the limit: each one trained on was cut, and counted
    assert all(row["truncated_samples"] == row["consumed_samples"] for row in rows.values())
    skipped = skipped_to_fill(prompt_lengths(run, data_path(data), "val"), lambda n: n < SFT_LIMIT, 8)
    assert (
        rows[6]["val_dropped_samples"] == skipped > 0
        and rows[6]["val_samples"] == rows[6]["val_samples_requested"] == 8
    )


def test_grpo_drop_trains_every_prompt_with_its_image_and_counts_the_drops(tmp_path, data):
    run = tmp_path / "run"
    small = ("train.global_batch_size=8", "grpo.num_generations=4", "train.max_steps=3")
    out = submit(GRPO, run, data, f"data.max_seq_len={GRPO_LIMIT}", "data.on_bad_sample=drop", *small)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = history(run / "metrics.jsonl")
    train = prompt_lengths(run, data_path(data), "train")
    trained = [k for row in rows.values() for k in row["sample_ids"]]
    assert len(trained) == 3 * 8 and all(train[k] <= GRPO_LIMIT for k in trained)
    assert rows[3]["dropped_samples"] > 0 and rows[3]["truncated_samples"] == 0
    # validation: a prompt must fit; its answer has grpo.max_new_tokens of room beyond data.max_seq_len
    skipped = skipped_to_fill(prompt_lengths(run, data_path(data), "val"), lambda n: n <= GRPO_LIMIT, 8)
    assert rows[3]["val_dropped_samples"] == skipped > 0 and rows[3]["val_samples"] == 8


# ---------------------------------------------------------------- a refused run resumed with drop

STOPS_AT = 10  # the planted sample is the first of this step's: `refuse` stops there, after checkpoints
PLANTED_SETS = [
    *("data.synthetic=null", "logger.wandb_mode=disabled", "parallel.dp=1", "train.max_steps=12"),
    *("train.val_samples=0", "checkpoint.save_period=2", "data.check_at_submit=false"),
]


@pytest.fixture(scope="module")
def planted(run_data, tmp_path_factory) -> tuple[list[str], str]:
    """(the settings of a run on a copy of the session's set in which one sample cannot fit, its key):
    the first sample of step STOPS_AT of that run, found with a loader shard of the run's settings."""
    from data_samples import with_long_question, write_corrupt_copy

    from vlmrun.config.load import load_recipe
    from vlmrun.data.loader import open_loader_shard
    from vlmrun.models.source import ensure_model

    folder = tmp_path_factory.mktemp("planted")
    clean = [f"data.path={data_path(run_data)}", *PLANTED_SETS]
    recipe = load_recipe(SFT, clean)
    model = ensure_model(recipe.model, folder / "cache", recipe.train.seed)
    shard = open_loader_shard(
        recipe, processor_dir=str(model), shard=0, num_shards=1, placement_hash="p", split="train"
    )
    per_step = recipe.train.global_batch_size // recipe.train.micro_batch_size
    try:
        key = [shard.next_batch() for _ in range(per_step * STOPS_AT)][-per_step].sample_ids[0]
    finally:
        shard.close()
    copy = write_corrupt_copy(Path(data_path(run_data)), folder / "set", {key: with_long_question})
    return [f"data.path={copy}", *PLANTED_SETS], key


def console_in_log(console: str, run: Path, attempt: int) -> list[str]:
    """The console's lines (a --wait command's stderr), each of which must be in the attempt's log."""
    logged = set((run / "logs" / f"attempt-{attempt}.log").read_text().splitlines())
    shown = [line for line in console.splitlines() if line.strip()]
    assert shown and [line for line in shown if line not in logged] == [], console[-3000:]
    return shown


def test_a_run_a_sample_stopped_resumes_with_drop_into_the_numbers_of_a_drop_run(tmp_path, planted):
    settings, key = planted
    stopped, dropping = tmp_path / "stopped", tmp_path / "dropping"
    out = submit(SFT, stopped, [], *settings)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"sample {key} " in job(stopped)["attempts"][0]["reason"] and max(sealed(stopped)) >= 2
    console_in_log(out.stderr, stopped, 0)
    resumed = vlmrun("resume", str(stopped), "--set", "data.on_bad_sample=drop", "--wait")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    change = "data.on_bad_sample: 'refuse' -> 'drop'"
    assert f"this resume changes {change}" in resumed.stdout
    attempts = job(stopped)["attempts"]
    assert attempts[1]["resumed_with"] == [change] and "resumed_with" not in attempts[0]
    assert "resume_changes" not in job(stopped)  # taken by the attempt it started
    out = submit(SFT, dropping, [], *settings, "data.on_bad_sample=drop")
    assert out.returncode == 0, out.stderr[-3000:]
    same_history(stopped, dropping, keys=("loss", "grad_norm", "lr", "valid_tokens", "sample_ids", "dropped_samples"))
    rows = history(stopped / "metrics.jsonl")
    assert rows[12]["dropped_samples"] == 1 and not any(key in row["sample_ids"] for row in rows.values())
    # the attempt log of a --wait run holds what its console showed: the line naming the dropped sample too
    for console, run in ((resumed.stderr, stopped), (out.stderr, dropping)):
        shown = console_in_log(console, run, len(job(run)["attempts"]) - 1)
        assert any("dropped sample" in line and f"key {key}" in line for line in shown), console[-3000:]
