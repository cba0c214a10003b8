"""Samples that do not fit data.max_seq_len, through real tiny runs via the CLI (local cluster: real Ray,
Energon and the tiny Qwen2.5-VL), SFT and GRPO. With `data.on_bad_sample: refuse` the run fails with
one line naming the sample, its token count and the limit (exit 2); with `drop` it trains, the rows
count the drops (and the SFT conversations cut), no trained sample is one that did not fit, and a
stopped-and-resumed run counts exactly what an uninterrupted one does.

On this data set (112 px images) every prompt has 32 or 33 tokens and every conversation 35 or 36:
at a limit of 33 a 33-token prompt leaves no answer token (SFT drops it) and every other SFT sample
is cut after its first answer tokens; at 32 the 33-token prompts do not fit (GRPO drops them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from data_samples import read_raw_samples
from test_grpo_e2e import GRPO, SFT, sets, vlmrun

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow
SFT_LIMIT, GRPO_LIMIT = 33, 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("long") / "clevr"
    return sets(
        f"data.path={path}",
        "data.synthetic={train: 256, val: 32, image_size: 112, seed: 0}",
        "logger.wandb_mode=disabled",
        "train.val_samples=8",
        "data.error_tolerance=256",  # two samples in five are dropped: more than the default allows
    )


def submit(recipe: str, run: Path, data: list[str], *items: str):
    return vlmrun("submit", recipe, "--cluster", "local", "--run-dir", str(run), *data, *sets(*items), "--wait")


def prompt_lengths(run: Path, data_path: str, split: str) -> dict[str, int]:
    """Every sample's prompt length in tokens, with the processor of the run's tiny model."""
    from vlmrun.config.families import family_spec
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import cook_conversation
    from vlmrun.data.loader import load_processor

    (model,) = (run / "cache" / "models").iterdir()
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


@pytest.mark.parametrize(("recipe", "limit"), [(SFT, SFT_LIMIT), (GRPO, GRPO_LIMIT)], ids=["sft", "grpo"])
def test_refuse_fails_the_run_in_one_line_naming_the_sample(tmp_path, data, recipe, limit):
    out = submit(recipe, tmp_path / "run", data, f"data.max_seq_len={limit}", "train.max_steps=3")
    assert out.returncode == 2, out.stderr[-3000:]
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    reason = job["attempts"][-1]["reason"]
    assert job["state"] == "FAILED" and "\n" not in reason
    assert reason.startswith("loader shard ") and ": sample train-" in reason
    assert re.search(rf" \d+ tokens[^;]*, more than data.max_seq_len={limit}\b", reason), reason
    assert "data.on_bad_sample=drop" in reason
    assert reason in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr


def test_sft_drop_trains_counts_and_never_trains_a_sample_that_does_not_fit(tmp_path, data):
    run = tmp_path / "run"
    out = submit(SFT, run, data, f"data.max_seq_len={SFT_LIMIT}", "data.on_bad_sample=drop", "train.max_steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = history(run / "metrics.jsonl")
    train = prompt_lengths(run, data_path(data), "train")
    trained = {k for row in rows.values() for k in row["sample_ids"]}
    assert trained and all(train[k] < SFT_LIMIT for k in trained)  # room for an answer token after the prompt
    drops = [rows[s]["dropped_samples"] for s in sorted(rows)]
    assert drops == sorted(drops) and drops[-1] > 0
    # every conversation here is longer than the limit: each one trained on was cut, and counted
    assert all(row["truncated_samples"] == row["consumed_samples"] for row in rows.values())
    skipped = skipped_to_fill(prompt_lengths(run, data_path(data), "val"), lambda n: n < SFT_LIMIT, 8)
    assert rows[6]["val_dropped_samples"] == skipped > 0 and rows[6]["val_samples"] == 8


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


def test_a_resumed_drop_run_counts_what_an_uninterrupted_one_does(tmp_path, data):
    drop = (f"data.max_seq_len={SFT_LIMIT}", "data.on_bad_sample=drop", "checkpoint.save_period=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert submit(SFT, straight, data, *drop, "train.max_steps=6").returncode == 0
    assert submit(SFT, resumed, data, *drop, "train.max_steps=3").returncode == 0
    out = vlmrun("resume", str(resumed), "--set", "train.max_steps=6", "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = history(straight / "metrics.jsonl"), history(resumed / "metrics.jsonl")
    for step in range(1, 7):
        for key in ("sample_ids", "loss", "dropped_samples", "truncated_samples"):
            assert a[step][key] == b[step][key], (step, key)
    assert b[4]["attempt"] == 1 and b[6]["dropped_samples"] > b[3]["dropped_samples"]
