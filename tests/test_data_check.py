"""`vlmrun data check` and the same check at submit: planted samples the run cannot train on (image
tokens spelled in the text, a cut that would fall inside the image, no answer token left) are found
and named; submit refuses them under data.on_bad_sample=refuse and trains with drop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_data_prepare import draw, turns
from vlmrun_cli import TINY, refused, rows, sets, vlmrun

from vlmrun.config.load import load_recipe
from vlmrun.data.check import check_data
from vlmrun.data.epochs import real_ids

MAX_SEQ_LEN = 96
LONG = " ".join(["how many objects are in this picture"] * 12)  # ~100 tokens: past MAX_SEQ_LEN on its own
GOOD = 40
#: row id -> what the check must call it at MAX_SEQ_LEN.
PLANTED = {
    "spelled-placeholder": "media_mismatch",  # a text-only row whose text spells the image token
    "spelled-with-image": "media_mismatch",  # one image, and the token spelled once more
    "image-after-long-text": "media_cut",  # cut at MAX_SEQ_LEN falls before the image ends
    "answer-after-long-text": "no_label",  # text only: no answer token would be left after the cut
}


def planted_rows(folder: Path) -> list[dict]:
    images = folder / "images"
    images.mkdir()
    files = [draw(images / f"{i}.jpg", (48 + 8 * i, 48), i) for i in range(4)]
    out = [
        {"id": f"good-{i}", "image": f"images/{files[i % 4].name}", "conversations": turns("<image> How many?", "2")}
        for i in range(GOOD)
    ]
    out += [{"id": f"text-{i}", "conversations": turns("Is a cube round?", "no")} for i in range(8)]
    image = f"images/{files[0].name}"
    out += [
        {"id": "spelled-placeholder", "conversations": turns("What is <|image_pad|> here?", "a token")},
        {"id": "spelled-with-image", "image": image, "conversations": turns("<image> and <|image_pad|>?", "1")},
        {"id": "image-after-long-text", "image": image, "conversations": turns(f"{LONG} <image>", "3")},
        {"id": "answer-after-long-text", "conversations": turns(LONG, "3")},
        {"id": "long-answer", "image": image, "conversations": turns("<image> Describe it.", LONG)},  # cut, kept
    ]
    return out


@pytest.fixture(scope="module")
def planted_set(tmp_path_factory) -> Path:
    """A prepared set whose every planted row is in the training split (val: good rows only)."""
    folder = tmp_path_factory.mktemp("planted")
    rows_ = planted_rows(folder)
    for row in rows_:
        row["split"] = "val" if row["id"] in {f"good-{i}" for i in range(8)} else "train"
    (folder / "chat.json").write_text(json.dumps(rows_))
    out = folder / "set"
    done = vlmrun(
        "data", "prepare", str(folder / "chat.json"), str(out), "--format", "llava", "--split-column", "split"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def recipe(data: Path, *overrides: str):
    return load_recipe(
        Path(TINY),
        [
            f"data.path={data}",
            "data.synthetic=null",
            f"data.max_seq_len={MAX_SEQ_LEN}",
            "train.val_samples=4",
            *overrides,
        ],
    )


def named_rows(data: Path, keys: list[str]) -> list[str]:
    """The source row ids of sample keys (each record keeps its row's `id`)."""
    import tarfile

    ids = {}
    for shard in data.glob("*.tar"):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    ids[member.name.removesuffix(".json")] = json.loads(tar.extractfile(member).read())["id"]
    return [ids[k] for k in keys]


def test_every_planted_sample_is_found_and_named(planted_set, tiny_dirs):
    result = check_data(recipe(planted_set), processor_dir=tiny_dirs["qwen2_5_vl"])
    train, val = result.splits
    assert (train.split, val.split) == ("train", "val")
    want: dict[str, int] = {}
    for kind in PLANTED.values():
        want[kind] = want.get(kind, 0) + 1
    assert train.bad == want and train.samples == GOOD - 8 + 8 + len(PLANTED) + 1
    assert train.ok == train.samples - len(PLANTED) and train.truncated == 1 and val.bad == {} and val.ok == 8
    named = {kind: [n.split(" (row ", 1)[1].split("):", 1)[0] for n in lines] for kind, lines in train.first.items()}
    assert {row: kind for kind, rows_ in named.items() for row in rows_} == PLANTED  # by the user's own row ids
    assert not result.ok and len(result.problems) == 1
    assert "data.on_bad_sample=refuse" in result.problems[0] and "4 sample(s)" in result.problems[0]


def test_drop_within_the_budget_fits_and_beyond_it_does_not(planted_set, tiny_dirs):
    drop = check_data(recipe(planted_set, "data.on_bad_sample=drop"), processor_dir=tiny_dirs["qwen2_5_vl"])
    assert drop.ok and drop.splits[0].unfit == len(PLANTED)
    tight = recipe(planted_set, "data.on_bad_sample=drop", "data.error_tolerance=1", "parallel.dp=2")
    over = check_data(tight, processor_dir=tiny_dirs["qwen2_5_vl"])
    assert not over.ok and "more than data.error_tolerance=1 for each of its 2 loader shard(s)" in over.problems[0]
    some = recipe(planted_set, "data.on_bad_sample=drop", "data.error_tolerance=2", "parallel.dp=2")
    assert check_data(some, processor_dir=tiny_dirs["qwen2_5_vl"]).warnings  # 4 > 2 for one shard: may fail


def test_a_longer_max_seq_len_fits_the_long_rows_but_not_a_spelled_placeholder(planted_set, tiny_dirs):
    result = check_data(recipe(planted_set, "data.max_seq_len=1024"), processor_dir=tiny_dirs["qwen2_5_vl"])
    assert result.splits[0].bad == {"media_mismatch": 2} and result.splits[0].truncated == 0


def test_a_missing_validation_split_is_named_as_data_val_split(planted_set):
    args = ("data", "check", str(planted_set), "--recipe", TINY)
    refused(
        vlmrun(*args, *sets("data.val_split=test")), "data.val_split", "'test'", "train, val", "train.val_samples=0"
    )
    refused(vlmrun(*args, *sets("data.split=test")), "data.split", "'test'", "train, val")


@pytest.mark.slow
def test_the_cli_names_the_samples_and_exits_1_then_0_with_drop(planted_set):
    args = ("data", "check", str(planted_set), "--recipe", TINY, *sets(f"data.max_seq_len={MAX_SEQ_LEN}"))
    done = vlmrun(*args, "--json")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["ok"] is False and result["splits"][0]["unfit"] == len(PLANTED)
    table = vlmrun(*args, *sets("data.on_bad_sample=drop"))
    assert table.returncode == 0, table.stdout[-2000:] + table.stderr[-2000:]
    assert "media_mismatch" in table.stdout and "the run would not stop on these samples" in table.stdout


@pytest.mark.slow
def test_submit_refuses_under_refuse_and_trains_with_drop(planted_set, tmp_path):
    quick = ["train.max_steps=3", "checkpoint.save_period=3", "train.val_period=3", "train.val_samples=4"]
    extra = sets(
        f"data.path={planted_set}",
        f"data.max_seq_len={MAX_SEQ_LEN}",
        "data.num_workers=0",
        "logger.wandb_mode=disabled",
        "parallel.dp=1",  # one rank: the check and the drop are the loader's, per shard
    )
    run = tmp_path / "refused"
    done = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *extra, *sets(*quick), "--wait")
    assert refused(done, "data.path") and "data.on_bad_sample=refuse" in done.stderr
    assert "media_mismatch" in done.stderr and not run.exists()
    run = tmp_path / "dropped"
    done = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--run-dir",
        str(run),
        *extra,
        *sets(*quick, "data.on_bad_sample=drop"),
        "--wait",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = rows(run)
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps)


def test_a_tar_file_the_index_names_but_that_is_gone_is_refused_naming_it(planted_set, tiny_dirs, tmp_path):
    import shutil

    from vlmrun.errors import InputError

    data = tmp_path / "set"
    shutil.copytree(planted_set, data)
    gone = sorted(data.glob("train-*.tar"))[0]
    gone.unlink()
    with pytest.raises(InputError, match=f"data.path: {gone} cannot be read") as err:
        check_data(recipe(data), processor_dir=tiny_dirs["qwen2_5_vl"])
    assert err.value.field == "data.path"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_refuses_or_drops_what_the_check_finds(planted_set, tiny_dirs, workers):
    """The run meets the same rules sample by sample (no check at submit needed): a spelled image token is
    refused in one line naming its kind, not a forward that fails on it; with drop the run trains around it."""
    from vlmrun.data.error_budget import SampleRefused
    from vlmrun.data.loader import open_loader_shard

    def shard(*overrides: str):
        r = recipe(planted_set, f"data.num_workers={workers}", "data.shuffle_buffer=0", *overrides)
        return open_loader_shard(
            r, processor_dir=tiny_dirs["qwen2_5_vl"], shard=0, num_shards=1, placement_hash="p", split="train"
        )

    refusing = shard()
    with pytest.raises(SampleRefused, match="data.on_bad_sample=refuse") as err:
        for _ in range(60):
            refusing.next_batch()
    refusing.close()
    assert "\n" not in str(err.value) and "vlmrun data check" in str(err.value)
    dropping = shard("data.on_bad_sample=drop")
    ids = real_ids(k for _ in range(60) for k in dropping.next_batch().sample_ids)  # fillers take the drops' places
    dropped = dropping.counts().dropped
    dropping.close()
    assert dropped >= len(PLANTED) and len(set(ids)) == GOOD - 8 + 8 + 1
    assert not set(named_rows(planted_set, sorted(set(ids)))) & set(PLANTED)
