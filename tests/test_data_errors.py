"""Corrupt samples (truncated member, undecodable image, JSON without messages, media pointing at a
missing member) are counted and skipped up to data.error_tolerance, then the shard fails naming
itself and the sample's key and tar file: quickly, never a hang."""

from __future__ import annotations

import pytest
from data_samples import make_recipe, without_messages, write_corrupt_copy

from vlmrun.data.epochs import real_ids
from vlmrun.data.error_budget import CorruptDataError
from vlmrun.data.loader import open_loader_shard

BAD = {
    "train-0000005": lambda m: {**m, "jpg": m["jpg"][: len(m["jpg"]) // 2]},  # truncated member
    "train-0000017": lambda m: {**m, "jpg": b"\x00garbage" * 20},  # undecodable image
    "train-0000040": without_messages,  # json without messages
    "train-0000070": lambda m: {k: v for k, v in m.items() if k != "jpg"},  # media ref to a missing member
}
TAR_OF = {
    "train-0000005": "train-000000.tar",
    "train-0000017": "train-000000.tar",
    "train-0000040": "train-000001.tar",
    "train-0000070": "train-000002.tar",
}
# A loader that stops making progress on bad data must fail the test, not hang it: pytest-timeout
# (signal method) raises in the main thread after this long, fixtures' set-up included (~1-3 s measured).
HANG_S = 120


@pytest.fixture(scope="module")
def corrupt_set(clevr_set, tmp_path_factory):
    return write_corrupt_copy(clevr_set, tmp_path_factory.mktemp("corrupt") / "set", BAD)


def open_corrupt(corrupt_set, tiny_dirs, **data):
    recipe = make_recipe(corrupt_set, **data)
    return open_loader_shard(
        recipe, processor_dir=tiny_dirs["qwen2_5_vl"], shard=0, num_shards=1, placement_hash="p", split="train"
    )


@pytest.mark.slow
@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_samples_are_skipped_within_the_tolerance(corrupt_set, tiny_dirs, workers):
    shard = open_corrupt(corrupt_set, tiny_dirs, num_workers=workers, error_tolerance=len(BAD))
    # two epochs: a bad sample met again is not counted again
    keys = [k for _ in range(96) for k in shard.next_batch().sample_ids]
    skipped = shard.state_dict()["corrupt_keys"]
    shard.close()
    assert set(skipped) == set(BAD)
    for epoch in (keys[:96], keys[96:]):  # each the good samples once, a filler for each bad one
        real = real_ids(epoch)
        assert not set(real) & set(BAD) and len(set(real)) == len(real) == 96 - len(BAD) == len(epoch) - len(BAD)


@pytest.mark.slow
@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("workers", [0, 2])
def test_one_more_corrupt_sample_fails_naming_shard_and_key(corrupt_set, tiny_dirs, workers):
    shard = open_corrupt(corrupt_set, tiny_dirs, num_workers=workers, error_tolerance=len(BAD) - 1)
    with pytest.raises(CorruptDataError) as err:
        for _ in range(96):
            shard.next_batch()
    shard.close()
    message = str(err.value)
    assert message.startswith(
        f"loader shard 0/1 (train): {len(BAD)} corrupt samples, more than data.error_tolerance={len(BAD) - 1}"
    )
    key = next(k for k in BAD if f"key {k} in {TAR_OF[k]}" in message)
    assert "Traceback" not in message and key


@pytest.mark.timeout(HANG_S)
def test_restored_shard_remembers_what_it_skipped(corrupt_set, tiny_dirs):
    shard = open_corrupt(corrupt_set, tiny_dirs, error_tolerance=len(BAD))
    for _ in range(48):
        shard.next_batch()
    state = shard.state_dict()
    shard.close()
    assert set(state["corrupt_keys"]) == set(BAD)
    again = open_corrupt(corrupt_set, tiny_dirs, error_tolerance=len(BAD))
    again.load_state_dict(state)
    for _ in range(48):  # the next epoch meets the same bad samples: still within the budget
        again.next_batch()
    again.close()


@pytest.mark.slow
def test_bench_json_stays_clean_when_samples_are_skipped(corrupt_set, tmp_path):
    import json
    import subprocess
    import sys

    import yaml

    recipe = make_recipe(corrupt_set, error_tolerance=len(BAD)).model_dump(mode="json", exclude_none=True)
    path = tmp_path / "corrupt.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # 40 micro-batches of 2 per row after 8 of warm-up: every row reads the whole split once
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmrun.cli",
            "bench-loader",
            str(path),
            "--workers",
            "0,1",
            "--batches",
            "40",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)  # one JSON object, nothing else on stdout
    assert {r["loader"] for r in result["results"]} == {"energon", "reference", "limit"}
    assert "skipped corrupt sample" in out.stderr and "Except" in out.stderr  # Energon's own lines too
