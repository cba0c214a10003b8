"""Samples that do not fit data.max_seq_len, through real Energon loader shards: with
`data.on_bad_sample: refuse` the shard fails on the first one with one line naming it, its token count
and the limit; with `drop` it skips them, counts them (within data.error_tolerance), and a restored
shard goes on with the same batches and the same count. No prompt ever loses its image; an SFT
conversation whose answer runs over is cut, with its image, and counted.
"""

from __future__ import annotations

import pytest
from data_samples import make_recipe, with_long_answer, with_long_question, write_corrupt_copy

from vlmrun.data.epochs import real_ids
from vlmrun.data.error_budget import CorruptDataError, SampleRefused
from vlmrun.data.loader import open_loader_shard, val_batches

LONG_QUESTIONS = ("train-0000005", "train-0000040", "train-0000070")
LONG_ANSWER = "train-0000017"
VAL_LONG = ("val-0000001", "val-0000003")
TAR_OF = {"train-0000005": "train-000000.tar", "train-0000040": "train-000001.tar", "train-0000070": "train-000002.tar"}
EPOCH = 96  # samples in the session set's train split
HANG_S = 120


@pytest.fixture(scope="module")
def long_set(clevr_set, tmp_path_factory):
    plant = {key: with_long_question for key in LONG_QUESTIONS + VAL_LONG} | {LONG_ANSWER: with_long_answer}
    return write_corrupt_copy(clevr_set, tmp_path_factory.mktemp("long") / "set", plant)


def open_shard(path, tiny_dirs, *, grpo: bool = False, **data):
    extra = dict(task_encoder="chat_grpo", train={"algorithm": "grpo"}) if grpo else {}
    recipe = make_recipe(path, **extra, **data)
    return open_loader_shard(
        recipe, processor_dir=tiny_dirs["qwen2_5_vl"], shard=0, num_shards=1, placement_hash="p", split="train"
    )


def take(shard, n: int) -> list:
    return [shard.next_batch() for _ in range(n)]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("grpo", [False, True], ids=["sft", "grpo"])
@pytest.mark.parametrize("workers", [0, 2])
def test_refuse_fails_on_the_first_over_long_sample_in_one_line(long_set, tiny_dirs, workers, grpo):
    shard = open_shard(long_set, tiny_dirs, grpo=grpo, num_workers=workers)
    with pytest.raises(SampleRefused) as err:
        take(shard, EPOCH)
    shard.close()
    message = str(err.value)
    key = next(k for k in LONG_QUESTIONS if f"sample {k} " in message)
    assert message.startswith(f"loader shard 0/1 (train): sample {key} ({TAR_OF[key]}): ")
    assert "tokens" in message and "more than data.max_seq_len=256" in message and "data.on_bad_sample" in message
    assert "\n" not in message and err.value.exit_code == 2


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("workers", [0, 2])
def test_drop_skips_and_counts_every_over_long_sample_and_cuts_the_long_answer(long_set, tiny_dirs, workers):
    shard = open_shard(long_set, tiny_dirs, num_workers=workers, on_bad_sample="drop")
    batches = take(shard, EPOCH)  # two epochs: 93 usable samples (96 - 3 dropped) and 3 fillers each
    counts = shard.counts()
    shard.close()
    ids = [k for b in batches for k in b.sample_ids]
    for epoch in (ids[:EPOCH], ids[EPOCH:]):  # every usable sample exactly once per epoch
        real = real_ids(epoch)
        assert not set(real) & set(LONG_QUESTIONS) and len(set(real)) == len(real) == EPOCH - len(LONG_QUESTIONS)
    assert counts.dropped >= len(LONG_QUESTIONS) and counts.truncated == ids.count(LONG_ANSWER) >= 1
    for b in batches:  # every sample kept its image: one grid row per sample
        assert b.media["image_grid_thw"].shape[0] == len(b) and b.input_ids.shape[1] <= 256


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("workers", [0, 2])
def test_grpo_prompts_keep_their_image_and_the_drops_are_counted(long_set, tiny_dirs, workers):
    shard = open_shard(long_set, tiny_dirs, grpo=True, num_workers=workers, on_bad_sample="drop")
    batches = take(shard, EPOCH)
    counts = shard.counts()
    shard.close()
    ids = [k for b in batches for k in b.sample_ids]
    assert not set(ids) & set(LONG_QUESTIONS) and LONG_ANSWER in ids  # its prompt fits
    assert counts.dropped >= 1 and counts.truncated == 0
    for b in batches:
        assert b.media["image_grid_thw"].shape[0] == len(b) and b.input_ids.shape[1] <= 256


def take_counting(shard, n: int) -> tuple[list, list]:
    """n batches as plain data, and the shard's counts after each."""
    from data_samples import flat

    batches, counts = [], []
    for _ in range(n):
        batches.append(flat(shard.next_batch()))
        counts.append(shard.counts())
    return batches, counts


@pytest.mark.slow  # a loader shard with its worker, read and restored again: seconds per case
@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(
    "saves",
    [[7], [30], [6, 1], [30, 1]],
    ids=["mid-group", "later", "again-right-after-a-restore", "later-and-again-right-after"],
)
def test_a_restored_shard_gives_the_same_batches_and_counts_at_every_batch(long_set, tiny_dirs, saves):
    from data_samples import same_batches

    def shard():
        return open_shard(long_set, tiny_dirs, num_workers=2, on_bad_sample="drop")

    total = sum(saves) + 24
    straight = shard()
    want, want_counts = take_counting(straight, total)
    straight.close()
    got, got_counts, current = [], [], shard()
    for n in saves:  # take n, save, and go on in a fresh shard from that state
        batches, counts = take_counting(current, n)
        got, got_counts = got + batches, got_counts + counts
        state = current.state_dict()
        current.close()
        current = shard()
        current.load_state_dict(state)
        assert current.counts() == got_counts[-1]
    batches, counts = take_counting(current, total - sum(saves))
    current.close()
    assert same_batches(got + batches, want) and got_counts + counts == want_counts
    assert want_counts[-1].dropped >= 1 and want_counts[-1].truncated >= 1


@pytest.mark.slow  # three loader shards, one worker held back for seconds
@pytest.mark.timeout(HANG_S)
def test_a_save_that_a_late_worker_answers_before_its_own_restore_still_resumes_exactly(
    long_set, tiny_dirs, monkeypatch
):
    """Energon's race (see `vlmrun.data.loader_state.settle_quiet_workers`), made certain: in the
    restored shard, worker 1 starts late and then lets its command thread answer the save before it
    has restored itself."""
    import threading
    import time
    import types

    from data_samples import same_batches
    from megatron.energon import savable_loader

    def shard():
        return open_shard(long_set, tiny_dirs, num_workers=2, on_bad_sample="drop")

    straight = shard()
    want, _ = take_counting(straight, 6 + 1 + 12)
    straight.close()
    first = shard()
    got, _ = take_counting(first, 6)
    state = first.state_dict()
    first.close()

    init_worker = savable_loader._init_worker

    def late_worker_one(seeds, worker_id):
        init_worker(seeds, worker_id)
        if worker_id == 1:
            time.sleep(3)  # the restored shard's save is sent meanwhile

    class CommandsFirst(threading.Thread):
        def start(self):
            super().start()
            time.sleep(1)  # the command thread takes the lock before the worker's own restore

    monkeypatch.setattr(savable_loader, "_init_worker", late_worker_one)
    monkeypatch.setattr(
        savable_loader, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": CommandsFirst})
    )
    second = shard()
    second.load_state_dict(state)
    batches, _ = take_counting(second, 1)
    state = second.state_dict()
    second.close()
    monkeypatch.undo()
    third = shard()
    third.load_state_dict(state)
    rest, _ = take_counting(third, 12)
    third.close()
    assert same_batches(got + batches + rest, want)


@pytest.mark.timeout(HANG_S)
def test_drops_beyond_the_tolerance_fail_naming_the_budget(long_set, tiny_dirs):
    shard = open_shard(long_set, tiny_dirs, on_bad_sample="drop", error_tolerance=len(LONG_QUESTIONS) - 1)
    with pytest.raises(CorruptDataError, match="more than data.error_tolerance=2") as err:
        take(shard, EPOCH)
    shard.close()
    assert "unfit under data.on_bad_sample=drop" in str(err.value) and "more than data.max_seq_len=256" in str(
        err.value
    )


def test_validation_drops_and_counts_or_refuses(long_set, tiny_dirs):
    recipe = make_recipe(long_set, on_bad_sample="drop")
    loss, prompts, dropped = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=6, batch_size=2)
    keys = [k for b in loss for k in b.sample_ids]
    assert keys == ["val-0000000", "val-0000002", *(f"val-{i:07d}" for i in range(4, 8))] and dropped == 2
    assert [k for b in prompts for k in b.sample_ids] == keys
    assert val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=1, batch_size=2).dropped == 0
    with pytest.raises(
        SampleRefused, match=r"sample val-0000001 \(val-000000.tar\): \d+ tokens, more than data.max_seq_len=256"
    ):
        val_batches(make_recipe(long_set), processor_dir=tiny_dirs["qwen2_5_vl"], samples=6, batch_size=2)


def test_validation_counts_every_drop_when_the_split_runs_out(long_set, tmp_path_factory, tiny_dirs):
    """Every val sample asked for, the split's last one among the dropped: each drop is counted."""
    from data_samples import VAL

    last = f"val-{VAL - 1:07d}"
    tail = write_corrupt_copy(long_set, tmp_path_factory.mktemp("tail") / "set", {last: with_long_question})
    val = val_batches(
        make_recipe(tail, on_bad_sample="drop"), processor_dir=tiny_dirs["qwen2_5_vl"], samples=VAL, batch_size=2
    )
    keys = [k for b in val.loss_batches for k in b.sample_ids]
    assert len(keys) == VAL - 3 and last not in keys and not set(keys) & set(VAL_LONG)
    assert val.dropped == 3
