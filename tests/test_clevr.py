"""The synthetic CLEVR generator: reproducible shards, right answers, a picture that matches the
scene, and a folder that Energon opens as prepared by `energon prepare`."""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import pytest
from PIL import Image

from vlmrun.datasets import clevr
from vlmrun.datasets.clevr import ensure_clevr, generate_clevr, read_complete
from vlmrun.datasets.clevr_scene import BACKGROUND, COLORS, SHAPES, placement_margin
from vlmrun.datasets.formats import CONVERSATION_SUBFLAVORS
from vlmrun.errors import InputError

TRAIN, VAL, SIZE = 160, 32, 112


def read_samples(folder: Path, split: str) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes}, read with plain tarfile in shard order."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob(f"{split}-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clevr") / "set"
    generate_clevr(out, train=TRAIN, val=VAL, image_size=SIZE, seed=7, samples_per_shard=64)
    return out


@pytest.fixture(scope="module")
def records(dataset) -> list[tuple[dict, Image.Image]]:
    result = []
    for split in ("train", "val"):
        for parts in read_samples(dataset, split).values():
            result.append((json.loads(parts["json"]), Image.open(io.BytesIO(parts["jpg"])).convert("RGB")))
    return result


def test_same_arguments_give_identical_shards_and_another_seed_does_not(tmp_path):
    kwargs = dict(train=20, val=6, image_size=SIZE, samples_per_shard=8)
    a = generate_clevr(tmp_path / "a", seed=1, **kwargs).path
    b = generate_clevr(tmp_path / "b", seed=1, **kwargs).path
    c = generate_clevr(tmp_path / "c", seed=2, **kwargs).path
    shards = sorted(p.name for p in a.glob("*.tar"))
    assert shards == [f"train-00000{i}.tar" for i in range(3)] + ["val-000000.tar"]
    for name in shards:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert all((a / n).read_bytes() != (c / n).read_bytes() for n in shards)
    with tarfile.open(a / "train-000000.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}


@pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")
def test_energon_iterates_both_splits_with_a_cooker(dataset):
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        basic_sample_keys,
        get_loader,
        get_train_dataset,
        get_val_dataset,
        stateless,
    )

    @dataclass
    class Conversation(Sample):
        record: dict
        image_shape: tuple

    @stateless
    def cook(crude: dict) -> Conversation:
        return Conversation(**basic_sample_keys(crude), record=crude["json"], image_shape=tuple(crude["jpg"].shape))

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook, has_subflavors=dict(CONVERSATION_SUBFLAVORS))]

    workers = WorkerConfig(rank=0, world_size=1, num_workers=0)
    train = get_train_dataset(
        dataset,
        split_part="train",
        worker_config=workers,
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=Encoder(),
    )
    val = get_val_dataset(dataset, split_part="val", worker_config=workers, batch_size=None, task_encoder=Encoder())
    for loader, split, count in ((train, "train", TRAIN), (val, "val", VAL)):
        samples = list(get_loader(loader))
        assert sorted(s.__key__ for s in samples) == [clevr.sample_key(split, i) for i in range(count)]
        assert {s.__subflavors__["format"] for s in samples} == {"vlmrun-conversation"}
        assert {s.image_shape for s in samples} == {(3, SIZE, SIZE)}
        assert samples[0].record["messages"][1]["role"] == "assistant"


def test_metadata_is_what_energon_prepare_writes(dataset):
    meta = dataset / ".nv-meta"
    assert (meta / "dataset.yaml").read_text().splitlines() == [
        "__module__: megatron.energon",
        "__class__: CrudeWebdataset",
        "subflavors:",
        "  format: vlmrun-conversation",
    ]
    info = json.loads((meta / ".info.json").read_text())
    assert info["shard_counts"] == {
        "train-000000.tar": 64,
        "train-000001.tar": 64,
        "train-000002.tar": 32,
        "val-000000.tar": VAL,
    }
    assert "train-{000000..000002}.tar" in (meta / "split.yaml").read_text()
    assert (meta / "index.sqlite").is_file() and (dataset / "val-000000.tar.idx").is_file()


def test_records_have_the_conversation_format(records):
    record, _ = records[0]
    assert set(record) == {"messages", "media", "template", "scene"}
    user, assistant = record["messages"]
    assert user["content"][0] == {"type": "image", "ref": "jpg"} and user["content"][1]["type"] == "text"
    assert assistant["content"][0]["type"] == "text"
    assert record["media"] == [{"ref": "jpg", "modality": "image", "width": SIZE, "height": SIZE}]


def recount(record: dict) -> str:
    """The answer, recomputed from the scene and the question text alone."""
    text = record["messages"][0]["content"][1]["text"]
    objects = record["scene"]
    colors, shapes = "|".join(COLORS), "|".join(SHAPES)

    def count(color=None, shape=None):
        return str(sum((color in (None, o["color"])) and (shape in (None, o["shape"])) for o in objects))

    patterns = {
        "count_all": (r"How many objects are there\?", lambda m: count()),
        "count_color": (rf"How many ({colors}) objects are there\?", lambda m: count(color=m[1])),
        "count_shape": (rf"How many ({shapes})s are there\?", lambda m: count(shape=m[1])),
        "count_color_shape": (
            rf"How many ({colors}) ({shapes})s are there\?",
            lambda m: count(m[1], m[2]),
        ),
        "exist_color_shape": (
            rf"Is there an? ({colors}) ({shapes})\?",
            lambda m: "yes" if count(m[1], m[2]) != "0" else "no",
        ),
    }
    pattern, answer = patterns[record["template"]]
    match = re.fullmatch(pattern, text)
    assert match, (record["template"], text)
    return answer(match)


def test_answers_are_right_for_the_scene(records):
    for record, _ in records:
        assert record["messages"][1]["content"][0]["text"] == recount(record)


def test_picture_shows_the_scene(records):
    palette = {**COLORS, "background": BACKGROUND}

    def nearest(rgb):
        distance = {name: sum((a - b) ** 2 for a, b in zip(c, rgb, strict=True)) for name, c in palette.items()}
        return min(distance, key=distance.get)

    for record, image in records:
        for obj in record["scene"]:
            x0, y0, x1, y1 = obj["bbox"]
            assert nearest(image.getpixel(((x0 + x1) // 2, (y0 + y1) // 2))) == obj["color"]
        assert nearest(image.getpixel((0, 0))) == "background"


def test_objects_do_not_overlap_and_stay_inside(records):
    margin = placement_margin(SIZE)
    for record, _ in records:
        boxes = [o["bbox"] for o in record["scene"]]
        assert 1 <= len(boxes)
        assert all(margin <= b[0] < b[2] <= SIZE - margin and margin <= b[1] < b[3] <= SIZE - margin for b in boxes)
        for a, b in combinations(boxes, 2):
            assert a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1]


def test_summary_counts_the_shards_and_is_not_degenerate(dataset, records):
    summary = read_complete(dataset)
    train = summary.splits["train"]
    assert summary.splits["val"].samples == VAL and train.samples == TRAIN
    answers = [r["messages"][1]["content"][0]["text"] for r, _ in records[:TRAIN]]
    assert train.answers == {a: answers.count(a) for a in train.answers} and sum(train.answers.values()) == TRAIN
    assert set(train.templates) == {
        "count_all",
        "count_color",
        "count_shape",
        "count_color_shape",
        "exist_color_shape",
    }
    assert train.majority_accuracy == max(train.answers.values()) / TRAIN < 0.4
    yes, no = train.answers["yes"], train.answers["no"]
    assert 0.3 < yes / (yes + no) < 0.7


def test_progress_reports_every_sample(tmp_path):
    calls = []
    generate_clevr(tmp_path / "p", train=5, val=3, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 8) for i in range(1, 9)]


def test_ensure_reuses_a_complete_set(tmp_path):
    out = tmp_path / "set"
    first = ensure_clevr(out, train=8, val=4, image_size=64, seed=0)
    shard_mtime = (out / "train-000000.tar").stat().st_mtime_ns
    calls = []
    again = ensure_clevr(out, train=8, val=4, image_size=64, seed=0, progress=lambda *a: calls.append(a))
    assert again == first and calls == []
    assert (out / "train-000000.tar").stat().st_mtime_ns == shard_mtime
    assert [p.name for p in tmp_path.iterdir()] == ["set"]


@pytest.mark.parametrize("field, value", [("seed", 1), ("val", 5), ("image_size", 72), ("image_format", "png")])
def test_ensure_refuses_a_set_made_with_other_parameters(tmp_path, field, value):
    wanted = dict(train=8, val=4, image_size=64, seed=0, image_format="jpg")
    ensure_clevr(tmp_path / "set", **wanted)
    with pytest.raises(InputError, match=field) as caught:
        ensure_clevr(tmp_path / "set", **{**wanted, field: value})
    assert caught.value.field == field


def test_interrupted_generation_is_not_mistaken_for_a_set(tmp_path, monkeypatch):
    out = tmp_path / "set"
    args = dict(train=8, val=4, image_size=64, seed=0)
    # A staging folder left by a killed run is ignored; so is a set without its marker.
    (tmp_path / ".set.partial-dead").mkdir()
    (tmp_path / ".set.partial-dead" / "train-000000.tar").write_bytes(b"torn")
    out.mkdir()
    (out / "train-000000.tar").write_bytes(b"torn")
    assert read_complete(out) is None
    summary = ensure_clevr(out, **args)
    assert summary.splits["train"].samples == 8 and read_complete(out) == summary
    # A shard truncated after the fact makes the set incomplete again.
    (out / "val-000000.tar").write_bytes(b"")
    assert read_complete(out) is None
    assert ensure_clevr(out, **args) == summary
    # A crash mid-generation leaves nothing that looks like a set, and no staging folder.
    fresh = tmp_path / "fresh"

    def crash(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(clevr, "prepare_crude_webdataset", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_clevr(fresh, **args)
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".set.partial-dead", "set"]


def test_foreign_folder_and_bad_arguments_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError) as caught:
        ensure_clevr(tmp_path, train=4, val=2, image_size=64, seed=0)
    assert caught.value.field == "out" and (tmp_path / "notes.txt").read_text() == "mine"
    for field, value in (("image_format", "gif"), ("image_size", 8), ("train", 0)):
        with pytest.raises(InputError) as caught:
            ensure_clevr(
                tmp_path / "new",
                **{"train": 4, "val": 2, "image_size": 64, "seed": 0, field: value},
            )
        assert caught.value.field == field
