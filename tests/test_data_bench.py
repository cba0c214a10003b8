"""The reference loader encodes exactly like the Energon path; bench-loader reports every loader kind
with the fields the CLI prints, as plain JSON."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from data_samples import SIZE, TRAIN, VAL, make_recipe, read_raw_samples
from vlmrun_cli import TINY, sets, vlmrun

from vlmrun.bench.reference import reference_loader
from vlmrun.config.families import family_spec
from vlmrun.data.chat_encoding import ConversationEncoder
from vlmrun.data.cookers import cook_conversation
from vlmrun.data.loader import load_processor

ROW_KEYS = {
    "loader",
    "num_workers",
    "samples_per_s",
    "samples_per_s_iqr",
    "mb_per_s",
    "p50_batch_ms",
    "p95_batch_ms",
    "stage_ms_per_sample",
    "peak_rss_mb",
    "rss_per_worker_mb",
    "measured_batches",
    "chunk_samples_per_s",
}


def test_reference_loader_decodes_and_encodes_like_the_task_encoder(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set)
    raw = read_raw_samples(clevr_set, "train")
    encoder = ConversationEncoder(
        load_processor(tiny_dirs["qwen2_5_vl"], "qwen2_5_vl"), family_spec("qwen2_5_vl"), recipe.data.max_seq_len
    )
    batches = reference_loader(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], split="train", num_workers=0)
    for _ in range(4):
        batch = next(batches)
        expected = encoder.collate([encoder.encode(cook_conversation(raw[k])) for k in batch.sample_ids])
        assert torch.equal(batch.input_ids, expected.input_ids) and torch.equal(batch.labels, expected.labels)
        assert batch.media.keys() == expected.media.keys() and expected.media  # images: pixels and grid sizes
        assert all(torch.equal(batch.media[k], expected.media[k]) for k in expected.media)
    batches.close()


@pytest.mark.slow
def test_bench_reports_every_loader_kind(clevr_set, tiny_dirs):
    from vlmrun.bench.loader import run_bench

    recipe = make_recipe(clevr_set, synthetic={"train": TRAIN, "val": VAL, "image_size": SIZE, "seed": 0})
    result = run_bench(
        recipe, workers=[0, 1], batches=8, rounds=2, image_size=SIZE, processor_dir=tiny_dirs["qwen2_5_vl"]
    )
    json.dumps(result)
    assert result["dataset"] == str(clevr_set) and result["image_size"] == SIZE
    rows = {(r["loader"], r["num_workers"]): r for r in result["results"]}
    assert set(rows) == {(kind, k) for kind in ("energon", "reference", "limit") for k in (0, 1)}
    for row in rows.values():
        assert ROW_KEYS <= set(row) and row["samples_per_s"] > 0 and row["measured_batches"] == 8
        assert row["p50_batch_ms"] <= row["p95_batch_ms"]
        low, high = row["samples_per_s_iqr"]
        assert low <= row["samples_per_s"] <= high  # the median of the chunks, inside their quartiles
        assert len(row["chunk_samples_per_s"]) == 2  # one chunk per round
    assert len(rows[("energon", 1)]["rss_per_worker_mb"]) == 1 and rows[("energon", 0)]["rss_per_worker_mb"] == []
    assert set(rows[("limit", 0)]["stage_ms_per_sample"]) == {"read", "decode", "processor", "collate"}
    for key in ("ratio_energon_vs_reference", "ratio_energon_vs_limit", "best", "target", "target_met"):
        assert key in result
    assert result["ratio_energon_vs_reference"] > 0 and result["ratio_energon_vs_limit"] > 0
    for kind in ("reference", "limit"):  # each ratio: the median over rounds of the best rows' chunk ratios
        spread = result["ratio_spread"][f"energon_vs_{kind}"]
        assert spread["rounds"] == 2 and spread["min"] <= spread["median"] <= spread["max"]
        assert result[f"ratio_energon_vs_{kind}"] == spread["median"]
        best = {k: rows[(k, result["best"][k]["num_workers"])]["chunk_samples_per_s"] for k in ("energon", kind)}
        per_round = sorted(e / o for e, o in zip(best["energon"], best[kind], strict=True))
        assert spread["min"] == round(per_round[0], 3) and spread["max"] == round(per_round[-1], 3)


@pytest.mark.slow  # a short bench-loader run through the CLI
def test_bench_loader_writes_nothing_beside_the_user_s_data_set(clevr_set, tmp_path):
    """Its tiny model goes to the user cache ($XDG_CACHE_HOME/vlmrun), not into a folder next to the data."""
    mine = tmp_path / "mine"
    shutil.copytree(clevr_set, mine / "set")
    cache = tmp_path / "cache"
    more = sets(f"data.path={mine / 'set'}", "data.synthetic=null")
    out = vlmrun(
        "bench-loader",
        TINY,
        "--workers",
        "0",
        "--batches",
        "2",
        *more,
        "--json",
        env={"XDG_CACHE_HOME": str(cache), "VLMRUN_TINY_MODELS": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in mine.iterdir()) == ["set"]
    assert any((cache / "vlmrun" / "models").iterdir())
