"""Exact epochs (vlmrun.data.epochs) through real Energon loader shards: an epoch, as many steps as the
run plans for it, trains every sample of the split exactly once in every layout (dp 1 and 2, loader
workers 0 to 2, a shuffle buffer larger than a shard's share, packed micro-batches, GRPO's prompts), and
a shard restored anywhere (mid-epoch, while its buffer drains, amid the fillers, at the epoch's end)
goes on with the batches of an uninterrupted one. The issue's case: 62 samples at dp=2 with the
default buffer of 64 drew 56 samples in "epoch 0", 39 of them unique."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from data_samples import flat, make_recipe, same_batches
from vlmrun_cli import TINY, sets, vlmrun

from vlmrun.algorithms.common.steps import plan_steps
from vlmrun.data.epochs import epoch_layout, is_filler, real_ids
from vlmrun.data.loader import open_loader_shard
from vlmrun.run.metrics import history

ODD = 62  # samples in the odd set's train split: no layout below divides it
HANG_S = 180


@pytest.fixture(scope="module")
def odd_set(tmp_path_factory):
    from vlmrun.datasets.clevr import generate_clevr

    path = tmp_path_factory.mktemp("odd") / "clevr62"
    generate_clevr(path, train=ODD, val=8, image_size=64, seed=0, samples_per_shard=16)
    return path


def open_shard(recipe, tiny_dirs, shard: int):
    return open_loader_shard(
        recipe,
        processor_dir=tiny_dirs[recipe.family],
        shard=shard,
        num_shards=recipe.parallel.dp,
        placement_hash="p",
        split="train",
    )


def epoch_ids(recipe, tiny_dirs, epochs: int) -> list[list[str]]:
    """Per epoch, the ids every shard handed out in that epoch's steps (the run's plan), fillers included."""
    plan = plan_steps(recipe, ODD)
    per_epoch = plan.steps_per_epoch * plan.micro_batches_per_replica
    out: list[list[str]] = [[] for _ in range(epochs)]
    for rank in range(recipe.parallel.dp):
        shard = open_shard(recipe, tiny_dirs, rank)
        for e in range(epochs):
            out[e] += [i for _ in range(per_epoch) for i in shard.next_batch().sample_ids]
        shard.close()
    return out


LAYOUTS = {
    # the issue's layout: the default recipe's buffer (64) over a shard's 31 samples, one worker per shard
    "dp2-buffer-over-shard": dict(dp=2, num_workers=1, shuffle_buffer=64, train={"global_batch_size": 8}),
    "dp1-in-process": dict(dp=1, num_workers=0, shuffle_buffer=64, train={"global_batch_size": 8}),
    "dp2-two-workers-3-micro-batches": dict(dp=2, num_workers=2, shuffle_buffer=4, train={"global_batch_size": 12}),
    "dp2-packed": dict(dp=2, num_workers=1, shuffle_buffer=16, pack_tokens=512, train={"global_batch_size": 8}),
    "dp2-grpo-prompts": dict(
        dp=2,
        num_workers=1,
        shuffle_buffer=64,
        task_encoder="chat_grpo",
        train={"algorithm": "grpo", "global_batch_size": 8},
    ),
}


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_epoch_trains_every_sample_exactly_once(odd_set, tiny_dirs, layout):
    recipe = make_recipe(odd_set, **LAYOUTS[layout])
    epochs = epoch_ids(recipe, tiny_dirs, epochs=2)
    want = {f"train-{i:07d}": 1 for i in range(ODD)}
    for e, ids in enumerate(epochs):
        assert Counter(real_ids(ids)) == want, f"epoch {e}: repeated or missing samples"
        assert sum(map(is_filler, ids)) == epoch_layout(recipe, ODD).fillers > 0
    assert epochs[0] != epochs[1]  # each epoch its own order


@pytest.mark.timeout(HANG_S)
def test_a_filler_repeats_a_sample_of_its_epoch_with_nothing_to_learn(odd_set, tiny_dirs):
    recipe = make_recipe(odd_set, num_workers=0, shuffle_buffer=64, train={"global_batch_size": 8})
    shard = open_shard(recipe, tiny_dirs, 0)
    batches = [shard.next_batch() for _ in range(plan_steps(recipe, ODD).steps_per_epoch * 4)]
    shard.close()
    rows = {i: (b, k) for b in batches for k, i in enumerate(b.sample_ids)}
    fillers = [i for i in rows if is_filler(i)]
    assert len(fillers) == 2  # 62 samples in 32 micro-batches of 2
    for i in fillers:
        b, k = rows[i]
        source, j = rows[i.split(".filler-")[0]]
        assert (b.labels[k] == -100).all() and (source.labels[j] != -100).any()
        n = int(b.attention_mask[k].sum())
        assert n == int(source.attention_mask[j].sum()) and b.input_ids[k, :n].equal(source.input_ids[j, :n])


def test_the_step_plan_counts_the_epochs_of_the_issue():
    """62 samples at dp=2, 8 a step: 8 steps an epoch (62 samples and 2 fillers), not 7 (56 of them)."""
    recipe = make_recipe("/unused", dp=2, num_workers=1, train={"global_batch_size": 8, "max_steps": 20})
    plan = plan_steps(recipe, ODD)
    assert (plan.steps_per_epoch, plan.max_steps, plan.capped) == (8, 8, True)
    assert plan.cap() == "train.epochs: 1 caps train.max_steps=20"
    assert plan.cap_advice().endswith("--set train.epochs=3 trains all 20")
    default = make_recipe("/unused", dp=2, num_workers=1, train={"global_batch_size": 8, "max_steps": 200})
    assert plan_steps(default, 2048).steps_per_epoch == 256 and epoch_layout(default, 2048).fillers == 0


def take(shard, n: int) -> list[dict]:
    return [flat(shard.next_batch()) for _ in range(n)]


@pytest.mark.slow  # a shard (with its workers) opened again after every save
@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_restored_anywhere_in_an_epoch_goes_on_exactly(odd_set, tiny_dirs, workers):
    """Shard 1 of 2 (31 samples, 16 micro-batches an epoch) saved after 5 micro-batches (mid-epoch, the
    buffer still filling with one worker per shard), 15 (the epoch's last: its filler still to come),
    16 (the epoch's end), 17 and 27 (right after a restore, and the next epoch's drain)."""
    recipe = make_recipe(odd_set, dp=2, num_workers=workers, shuffle_buffer=16, train={"global_batch_size": 8})
    saves, total = [5, 10, 1, 1, 10], 40
    straight = open_shard(recipe, tiny_dirs, 1)
    want = take(straight, total)
    straight.close()
    got, current = [], open_shard(recipe, tiny_dirs, 1)
    for n in saves:
        got += take(current, n)
        state = current.state_dict()
        current.close()
        current = open_shard(recipe, tiny_dirs, 1)
        current.load_state_dict(state)
    got += take(current, total - sum(saves))
    current.close()
    assert same_batches(got, want), "a restored shard's batches differ from the uninterrupted ones"
    ids = [i for b in got for i in b["ids"]]
    for e in range(2):  # 16 micro-batches of 2 an epoch: the shard's 31 samples and a filler
        epoch = ids[32 * e : 32 * (e + 1)]
        assert len(set(real_ids(epoch))) == len(real_ids(epoch)) == 31 and sum(map(is_filler, epoch)) == 1


@pytest.mark.slow  # one real run through the CLI
def test_a_run_of_one_epoch_trains_each_sample_once_and_says_what_capped_it(tmp_path):
    """The issue's run: 62 samples, dp=2, `--set train.max_steps=20` under train.epochs: 1."""
    run = tmp_path / "run"
    data = sets(f"data.path={tmp_path / 'data'}", f"data.synthetic={{train: {ODD}, val: 8, image_size: 64}}")
    more = sets("train.max_steps=20", "train.val_samples=0", "logger.wandb_mode=disabled")
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *data, *more, "--wait")
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "note: train.epochs: 1 caps train.max_steps=20 to 8 steps" in said
    assert "step 8/8 (train.epochs: 1 caps train.max_steps=20)" in said
    rows = history(run / "metrics.jsonl")
    assert sorted(rows) == list(range(1, 9)) and {r["epoch"] for r in rows.values()} == {0}
    ids = [i for r in rows.values() for i in r["sample_ids"]]
    assert sorted(ids) == [f"train-{i:07d}" for i in range(ODD)] and rows[8]["consumed_samples"] == ODD
    reason = json.loads((run / "job.json").read_text())["reason"]
    assert reason.startswith("finished at step 8 of 8 (train.epochs: 1 caps train.max_steps=20)"), reason
