"""Loader shards: exact resume in a fresh process for shard r of R with 0-2 workers, identical streams
across processes, disjoint shards, refused restores (identity change, other shard, too late),
validation batches in a fixed order, virtual epochs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from data_samples import TRAIN, VAL, flat, make_recipe, same_batches

from vlmrun.data.fingerprint import LoaderStateRefused
from vlmrun.data.loader import open_loader_shard, val_batches
from vlmrun.data.splits import split_size
from vlmrun.errors import InputError

CONTINUE = 20
# Restores every job in one fresh interpreter: nothing of the saving process survives in it.
RESTORE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vlmrun.config.recipe import Recipe
    from vlmrun.data.loader import open_loader_shard
    from data_samples import flat
    for job in json.load(open(sys.argv[1])):
        shard = open_loader_shard(Recipe.model_validate_json(job["recipe"]), processor_dir=job["processor_dir"],
                                  shard=job["shard"], num_shards=job["num_shards"], placement_hash="p",
                                  split="train")
        if job["state"]:
            shard.load_state_dict(torch.load(job["state"], weights_only=True))
        torch.save([flat(shard.next_batch()) for _ in range(job["n"])], job["out"])
        shard.close()
    """
)


def open_shard(recipe, tiny_dirs, shard=0, num_shards=1, placement_hash="p"):
    return open_loader_shard(
        recipe,
        processor_dir=tiny_dirs[recipe.family],
        shard=shard,
        num_shards=num_shards,
        placement_hash=placement_hash,
        split="train",
    )


def run_fresh_process(jobs: list[dict], tmp_path) -> None:
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    script = tmp_path / "restore.py"
    script.write_text(RESTORE_SCRIPT)
    tests_dir = str(Path(__file__).parent)
    os = __import__("os")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(script), str(spec)], check=True, timeout=240, env=env)


def test_split_size_comes_from_nv_meta(clevr_set):
    assert split_size(str(clevr_set), "train") == TRAIN
    assert split_size(str(clevr_set), "val") == VAL


def test_missing_split_or_unprepared_folder_is_an_input_error(clevr_set, tmp_path):
    with pytest.raises(InputError) as err:
        split_size(str(clevr_set), "test")
    assert err.value.field == "data.split" and "train, val" in str(err.value)
    with pytest.raises(InputError) as err:
        split_size(str(tmp_path), "train")
    assert err.value.field == "data.path"


@pytest.mark.slow
def test_exact_resume_in_a_fresh_process(clevr_set, tiny_dirs, tmp_path):
    """Save mid-epoch (and mid transfer group), restore in a new interpreter: the next 20 batches are
    those the saving shard produced by continuing; a fresh shard there also repeats the stream. Each
    shard count (1, 2, 4) and each worker count (0: in process, 1, 2 forked workers) is taken once."""
    jobs, expected = [], {}
    for num_shards, workers in ((1, 0), (2, 2), (4, 1)):
        recipe = make_recipe(clevr_set, num_workers=workers)
        rank = num_shards - 1
        shard = open_shard(recipe, tiny_dirs, rank, num_shards)
        head = [flat(shard.next_batch()) for _ in range(5)]
        state = tmp_path / f"state-{num_shards}-{workers}.pt"
        torch.save(shard.state_dict(), state)
        name = f"{num_shards}-{workers}"
        expected[name] = [flat(shard.next_batch()) for _ in range(CONTINUE)]
        expected[f"{name}-fresh"] = head
        shard.close()
        common = {
            "recipe": recipe.model_dump_json(),
            "processor_dir": tiny_dirs[recipe.family],
            "shard": rank,
            "num_shards": num_shards,
        }
        jobs.append({**common, "state": str(state), "n": CONTINUE, "out": str(tmp_path / f"{name}.pt")})
        if workers != 1:
            jobs.append({**common, "state": None, "n": 5, "out": str(tmp_path / f"{name}-fresh.pt")})
    run_fresh_process(jobs, tmp_path)
    for job in jobs:
        name = Path(job["out"]).stem
        got = torch.load(job["out"], weights_only=True)
        assert same_batches(got, expected[name]), f"stream differs after restore: shards-workers {name}"


def test_shards_are_disjoint_and_cover_the_split(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set, shuffle_buffer=0)
    seen = []
    for rank in range(2):
        shard = open_shard(recipe, tiny_dirs, rank, 2)
        keys = [k for _ in range(TRAIN // 2 // 2) for k in shard.next_batch().sample_ids]
        shard.close()
        assert len(set(keys)) == len(keys) == TRAIN // 2
        seen.append(set(keys))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == TRAIN


def test_state_of_shard_1_is_refused_by_shard_0(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set)
    one = open_shard(recipe, tiny_dirs, 1, 2)
    one.next_batch()
    state = one.state_dict()
    one.close()
    zero = open_shard(recipe, tiny_dirs, 0, 2)
    with pytest.raises(LoaderStateRefused, match=r"topology\.shard: 1 -> 0"):
        zero.load_state_dict(state)
    zero.close()


def test_restore_after_the_first_batch_is_refused(clevr_set, tiny_dirs):
    shard = open_shard(make_recipe(clevr_set), tiny_dirs)
    state = shard.state_dict()
    shard.next_batch()
    with pytest.raises(LoaderStateRefused, match="before the first batch"):
        shard.load_state_dict(state)
    with pytest.raises(LoaderStateRefused, match="not a loader state"):
        open_shard(make_recipe(clevr_set), tiny_dirs).load_state_dict({"model": 1})
    shard.close()


def test_changed_settings_are_refused_naming_each_field(clevr_set, tiny_dirs):
    shard = open_shard(make_recipe(clevr_set, num_workers=0), tiny_dirs)
    shard.next_batch()
    state = shard.state_dict()
    shard.close()
    other = open_shard(make_recipe(clevr_set, num_workers=1, max_seq_len=300), tiny_dirs)
    with pytest.raises(LoaderStateRefused) as err:
        other.load_state_dict(state)
    assert "data.num_workers: 0 -> 1" in str(err.value) and "data.max_seq_len: 256 -> 300" in str(err.value)
    assert err.value.exit_code == 2
    other.close()


def test_val_batches_are_the_first_samples_in_order(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set)
    loss, prompts, dropped = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=5, batch_size=2)
    keys = [k for b in loss for k in b.sample_ids]
    assert keys == [f"val-{i:07d}" for i in range(5)] == [k for b in prompts for k in b.sample_ids]
    assert [len(b) for b in loss] == [2, 2, 1] and dropped == 0
    again, _, _ = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=5, batch_size=2)
    assert same_batches([flat(b) for b in again], [flat(b) for b in loss])
    assert all(p.attention_mask[:, -1].all() for p in prompts)  # left-padded: every prompt ends at the edge
    assert all(len(p.answers) == len(p) for p in prompts)


def test_virtual_epochs_follow_each_other(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set, virtual_epoch_length=8)
    shard = open_shard(recipe, tiny_dirs)
    keys = [k for _ in range(12) for k in shard.next_batch().sample_ids]
    shard.close()
    assert len(keys) == 24 and all(k.startswith("train-") for k in keys)


def test_a_loader_in_a_frozen_process_leaves_its_heap_frozen(clevr_set, tiny_dirs):
    """A rank freezes its heap once set up (`vlmrun.startup.freeze_heap`) so that no full collection
    walks torch's and transformers' objects again. A training shard iterated in that process
    (num_workers 0) and the validation set read there must leave it frozen: Energon's default
    unfroze all of it when an iteration ended."""
    import gc

    recipe = make_recipe(clevr_set)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        shard = open_shard(recipe, tiny_dirs)
        shard.next_batch()
        shard.close()
        # (a frozen object that dies leaves the count; an unfreeze empties it)
        assert gc.get_freeze_count() > frozen // 2, "the training shard unfroze the heap"
        val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=3, batch_size=2)
        assert gc.get_freeze_count() > frozen // 2, "reading the validation set unfroze the heap"
    finally:
        gc.unfreeze()
