"""`vlmrun data prepare`: a user's LLaVA, parquet or WebDataset conversations become an Energon set that
the tiny recipe trains on; broken rows are counted and named, within a budget; nothing is downloaded;
an existing OUT is never half-written."""

from __future__ import annotations

import io
import json
import math
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from data_samples import read_raw_samples as read_samples
from PIL import Image
from vlmrun_cli import ENV, TINY, command, refused, rows, sealed, sets, vlmrun

from vlmrun.data.cookers import cook_conversation, media_pixels
from vlmrun.datasets.user_data import BadRowBudget, prepare_user_data, read_prepared, split_of
from vlmrun.datasets.user_readers import SourceSpec
from vlmrun.datasets.user_rows import BadRow, make_row
from vlmrun.errors import InputError

SIZES = [(40, 40), (64, 48), (48, 96), (112, 80), (72, 72), (96, 56)]
QUESTIONS = ["How many objects are there?", "Is there a red cube?", "How many blue spheres are there?"]
ONE, TWO, TEXT = 200, 50, 40  # rows with one image, two images, none
BROKEN = {
    "missing-file": "missing_image",
    "corrupt-file": "undecodable_image",
    "no-answer": "no_assistant_turn",
    "url-image": "url_image",
    "too-many-placeholders": "placeholder_mismatch",
}


def draw(path: Path, size: tuple[int, int], seed: int) -> Path:
    """A small picture with a colored box, as JPEG or PNG by the file name."""
    image = Image.new("RGB", size, (20 * seed % 255, 90, 160))
    image.paste((240, 200 - seed % 100, 30), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    image.save(path)
    return path


def turns(question: str, answer: str | None) -> list[dict]:
    out = [{"from": "human", "value": question}]
    return out + ([{"from": "gpt", "value": answer}] if answer is not None else [])


def llava_rows(folder: Path) -> list[dict]:
    """The rows of the acceptance set: one and two images of several sizes, text only, and BROKEN."""
    images = folder / "images"
    images.mkdir()
    files = [draw(images / f"{i}.{'png' if i % 3 == 0 else 'jpg'}", SIZES[i % len(SIZES)], i) for i in range(12)]
    (images / "corrupt.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    out = []
    for i in range(ONE):
        question = QUESTIONS[i % 3] if i % 4 == 0 else f"<image>\n{QUESTIONS[i % 3]}"  # some without placeholder
        out.append({"id": f"one-{i}", "image": f"images/{files[i % 12].name}", "conversations": turns(question, "2")})
    for i in range(TWO):
        pair = [f"images/{files[i % 12].name}", f"images/{files[(i + 5) % 12].name}"]
        out.append({"id": f"two-{i}", "image": pair, "conversations": turns("Left <image> right <image>: same?", "no")})
    out += [{"id": f"text-{i}", "conversations": turns("Is a cube round?", "no")} for i in range(TEXT)]
    image = f"images/{files[0].name}"
    out += [
        {"id": "missing-file", "image": "images/gone.jpg", "conversations": turns("<image> What is it?", "1")},
        {"id": "corrupt-file", "image": "images/corrupt.jpg", "conversations": turns("<image> What?", "1")},
        {"id": "no-answer", "image": image, "conversations": turns("<image> How many?", None)},
        {"id": "url-image", "image": "https://example.com/cat.jpg", "conversations": turns("<image> Cat?", "yes")},
        {"id": "too-many-placeholders", "image": image, "conversations": turns("<image> <image> Two?", "no")},
    ]
    return out


@pytest.fixture(scope="module")
def llava_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llava")
    (folder / "chat.json").write_text(json.dumps(llava_rows(folder)))
    return folder / "chat.json"


@pytest.fixture(scope="module")
def llava_set(llava_source, tmp_path_factory) -> tuple[Path, dict]:
    """`vlmrun data prepare chat.json OUT --format llava --json`, run once: (OUT, its JSON)."""
    out = tmp_path_factory.mktemp("prepared") / "set"
    done = vlmrun("data", "prepare", str(llava_source), str(out), "--format", "llava", "--seed", "3", "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads(done.stdout)


def test_llava_conversion_counts_every_row_and_names_the_broken_ones(llava_set):
    out, summary = llava_set
    total = ONE + TWO + TEXT + len(BROKEN)
    assert summary["rows_read"] == total and summary["bad_rows"] == len(BROKEN)
    assert summary["train"] + summary["val"] == ONE + TWO + TEXT and summary["val"] > 0
    assert summary["images"] == ONE + 2 * TWO and summary["text_only"] == TEXT
    by_reason = summary["bad_rows_by_reason"]
    assert {reason: info["rows"] for reason, info in by_reason.items()} == {r: [i] for i, r in BROKEN.items()}
    assert (
        "gone.jpg" in by_reason["missing_image"]["first"] and "corrupt.jpg" in by_reason["undecodable_image"]["first"]
    )
    assert "https://example.com/cat.jpg" in by_reason["url_image"]["first"]
    assert read_prepared(out) == {k: v for k, v in summary.items() if k != "path"}


def test_json_output_has_one_shape(llava_set):
    out, summary = llava_set
    assert set(summary) == {
        *("path", "source", "format", "rows_read", "train", "val", "images", "text_only"),
        *("bad_rows", "max_bad_rows", "bad_rows_by_reason", "split"),
    }
    assert summary["path"] == str(out) and summary["format"] == "llava" and summary["max_bad_rows"] == 16
    assert summary["split"] == {"val_ratio": 0.05, "seed": 3}
    for info in summary["bad_rows_by_reason"].values():
        assert set(info) == {"count", "what", "rows", "first"} and info["count"] == len(info["rows"]) == 1


def test_records_keep_the_source_images_and_cook_into_conversations(llava_set, llava_source):
    out, _ = llava_set
    samples = {**read_samples(out, "train"), **read_samples(out, "val")}
    by_id = {json.loads(s["json"])["id"]: s for s in samples.values()}
    source = {row["id"]: row for row in json.loads(llava_source.read_text())}
    assert sorted(by_id) == sorted(i for i in source if i not in BROKEN)
    for row_id in ("one-0", "one-1", "two-3", "text-0"):
        sample, row = by_id[row_id], source[row_id]
        conv = cook_conversation(sample)
        files = [row["image"]] if isinstance(row.get("image"), str) else row.get("image", [])
        assert [m.metadata["ref"] for m in conv.media] == [f"{i}.{f.rsplit('.', 1)[1]}" for i, f in enumerate(files)]
        for i, name in enumerate(files):
            assert conv.media[i].data == (llava_source.parent / name).read_bytes()  # the bytes as given
            width, height = Image.open(llava_source.parent / name).size
            assert tuple(media_pixels(conv, i).shape) == (3, height, width)
            assert (conv.media[i].metadata["width"], conv.media[i].metadata["height"]) == (width, height)
        assert sum(p["type"] == "image" for p in conv.messages[0]["content"]) == len(files)
        assert conv.messages[-1] == {
            "role": "assistant",
            "content": [{"type": "text", "text": row["conversations"][1]["value"]}],
        }
        assert conv.annotations == {"id": row_id}
    assert [p["type"] for p in cook_conversation(by_id["two-0"]).messages[0]["content"]] == [
        *("text", "image", "text", "image", "text")
    ]


def test_a_recipe_that_names_a_synthetic_set_uses_the_prepared_one_as_it_is(llava_set):
    from vlmrun.config.data import DataConfig
    from vlmrun.datasets.prepare import ensure_dataset

    out, _ = llava_set
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert ensure_dataset(DataConfig(path=str(out), synthetic={"train": 8, "val": 4})) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.slow
def test_the_tiny_recipe_trains_on_the_prepared_set(llava_set, tmp_path):
    out, _ = llava_set
    quick = ["train.max_steps=4", "checkpoint.save_period=2", "train.val_period=4", "train.val_samples=8"]
    extra = sets(f"data.path={out}", "data.num_workers=0", "logger.wandb_mode=disabled", "parallel.dp=1", *quick)
    run = tmp_path / "run"
    done = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *extra, "--wait")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = rows(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["valid_tokens"] > 0 for r in steps)
    assert math.isfinite(steps[-1]["val_loss"]) and steps[-1]["val_samples"] > 0
    assert sealed(run)[-1] == 4
    assert read_prepared(out) is not None  # the recipe's data.synthetic did not replace the set


def test_table_names_bad_rows_and_out_is_never_overwritten_unasked(tmp_path):
    src = tmp_path / "chat.jsonl"
    image = draw(tmp_path / "a.png", (40, 30), 1)
    good = {"id": "ok", "image": image.name, "conversations": turns("<image> How many?", "1")}
    bad = {"id": "web", "image": "s3://bucket/a.png", "conversations": turns("<image> How many?", "1")}
    src.write_text("\n".join(json.dumps(r) for r in (good, good | {"id": "ok2"}, bad)) + "\n")
    out = tmp_path / "set"
    wide = {"COLUMNS": "200"}  # a terminal wide enough that no cell wraps
    done = vlmrun("data", "prepare", str(src), str(out), "--format", "llava", "--val-ratio", "0", env=wide)
    assert done.returncode == 0, done.stderr[-3000:]
    for word in ("rows read", "url_image", "web", "s3://bucket/a.png", "no val split"):
        assert word in done.stdout, (word, done.stdout)
    again = vlmrun("data", "prepare", str(src), str(out), "--format", "llava", "--json")
    refused(again, "--overwrite", str(out))
    assert json.loads(again.stdout)["kind"] == "bad_input"


def test_bad_input_with_json_is_one_json_object_naming_the_field(tmp_path):
    done = vlmrun("data", "prepare", str(tmp_path / "nope.json"), str(tmp_path / "set"), "--format", "llava", "--json")
    refused(done, "nope.json", "does not exist")
    error = json.loads(done.stdout)
    assert (error["field"], error["kind"], error["exit_code"]) == ("src", "bad_input", 2)
    assert list(tmp_path.iterdir()) == []


def test_too_many_bad_rows_stop_the_cli_before_out_exists(tmp_path):
    src = tmp_path / "chat.json"
    rows_ = [{"id": f"r{i}", "image": f"gone-{i}.jpg", "conversations": turns("<image>?", "1")} for i in range(4)]
    src.write_text(json.dumps(rows_))
    done = vlmrun("data", "prepare", str(src), str(tmp_path / "set"), "--format", "llava", "--max-bad-rows", "2")
    err = refused(done, "--max-bad-rows", "3 bad rows", "r0, r1, r2", "missing_image")
    assert "gone-0.jpg" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]


# ---------------------------------------------------------------- in process: small sources


def text_rows(n: int) -> list[dict]:
    return [{"id": f"row-{i}", "conversations": turns("Is a cube round?", "no")} for i in range(n)]


def prepare(tmp_path: Path, rows_: list[dict], name: str = "set", **kwargs):
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(rows_))
    kwargs.setdefault("budget", BadRowBudget.parse("16"))
    return prepare_user_data(SourceSpec(format="llava", path=src), tmp_path / name, **kwargs).to_json()


def members(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


def val_ids(out: Path) -> set[str]:
    return {json.loads(s["json"])["id"] for s in read_samples(out, "val").values()}


def test_split_is_a_function_of_id_and_seed(tmp_path):
    ids = [f"row-{i}" for i in range(400)]
    one = [split_of(i, seed=0, val_ratio=0.2) for i in ids]
    assert one == [split_of(i, seed=0, val_ratio=0.2) for i in ids]
    assert 40 < one.count("val") < 120
    assert one != [split_of(i, seed=1, val_ratio=0.2) for i in ids]
    prepare(tmp_path, text_rows(60), "a", val_ratio=0.3, seed=5)
    prepare(tmp_path, text_rows(60), "b", val_ratio=0.3, seed=5)
    prepare(tmp_path, text_rows(60), "c", val_ratio=0.3, seed=6)
    assert members(tmp_path / "a") == members(tmp_path / "b")  # same source and seed: the same bytes
    assert val_ids(tmp_path / "a") == {
        f"row-{i}" for i in range(60) if split_of(f"row-{i}", seed=5, val_ratio=0.3) == "val"
    }
    assert val_ids(tmp_path / "a") != val_ids(tmp_path / "c")
    # the split of a row does not depend on the other rows
    prepare(tmp_path, text_rows(60)[::-1][:40], "d", val_ratio=0.3, seed=5)
    assert val_ids(tmp_path / "d") == val_ids(tmp_path / "a") - {f"row-{i}" for i in range(20)}


def test_a_split_column_decides_the_split(tmp_path):
    rows_ = [r | {"part": "val" if i % 4 == 0 else "train"} for i, r in enumerate(text_rows(12))]
    rows_[5]["part"] = "test"
    src = tmp_path / "s.json"
    src.write_text(json.dumps(rows_))
    spec = SourceSpec(format="llava", path=src, split_column="part")
    calls = []
    budget = BadRowBudget.parse("1")
    summary = prepare_user_data(spec, tmp_path / "set", budget=budget, progress=lambda *a: calls.append(a)).to_json()
    assert calls[-1] == (12, 12)
    assert (summary["train"], summary["val"], summary["split"]) == (8, 3, {"column": "part"})
    assert summary["bad_rows_by_reason"]["malformed"]["rows"] == ["row-5"]
    with pytest.raises(InputError) as caught:
        prepare_user_data(spec, tmp_path / "other", val_ratio=0.1, budget=BadRowBudget.parse("1"))
    assert caught.value.field == "--val-ratio"


@pytest.mark.parametrize(
    "url", ["http://a/b.jpg", "https://a/b.png", "s3://bucket/key.jpg", "gs://b/k", " HTTPS://x/y"]
)
def test_an_image_url_is_refused_naming_the_row_and_never_fetched(url, tmp_path):
    with pytest.raises(BadRow) as caught:
        make_row("row-9", turns("<image> What?", "a"), [str(tmp_path / "ok.jpg"), url], tmp_path)
    assert caught.value.reason == "url_image" and caught.value.row_id == "row-9"
    assert url.strip() in str(caught.value) and "row-9" in str(caught.value)


def content(row) -> list:
    return [[p.get("text", p.get("image")) for p in m["content"]] for m in row.messages]


def test_placeholders_place_images_in_order_or_before_the_first_human_text(tmp_path):
    two = ["a.jpg", "b.jpg"]
    row = make_row("r", turns("Left <image>\nright <image> same?", "no"), two, tmp_path)
    assert content(row) == [["Left", 0, "right", 1, "same?"], ["no"]]
    assert [s.path for s in row.images] == [tmp_path / "a.jpg", tmp_path / "b.jpg"]
    system = [{"from": "system", "value": "Be brief."}, *turns("Same?", "no")]
    assert content(make_row("r", system, two, tmp_path)) == [["Be brief."], [0, 1, "Same?"], ["no"]]
    multi = turns("<image> How many?", "2") + turns("And <image>?", "3")
    assert content(make_row("r", multi, two, tmp_path)) == [[0, "How many?"], ["2"], ["And", 1, "?"], ["3"]]
    assert make_row("r", turns("Hi", "Hello"), None, tmp_path).images == []
    for conversation, images, reason in [
        (turns("<image> <image>", "x"), ["a.jpg"], "placeholder_mismatch"),
        (turns("<image> Hi", "x"), None, "placeholder_mismatch"),
        (turns("What <image>", "x"), two, "placeholder_mismatch"),
        ([{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<image>"}], ["a.jpg"], "placeholder_mismatch"),
        (turns("<image>", "   "), ["a.jpg"], "empty_text"),
        (turns("", "x"), None, "empty_text"),
        (turns("Hi", None), None, "no_assistant_turn"),
        (turns("Hi", "x") + turns("More?", None), None, "no_assistant_turn"),
        ([{"from": "robot", "value": "x"}], None, "malformed"),
    ]:
        with pytest.raises(BadRow) as caught:
            make_row("r", conversation, images, tmp_path)
        assert caught.value.reason == reason, (conversation, caught.value)


def test_the_bad_row_budget_counts_or_takes_a_fraction(tmp_path):
    image = draw(tmp_path / "a.jpg", (32, 32), 0).name
    rows_ = text_rows(10) + [{"id": f"bad-{i}", "image": image, "conversations": turns("Q", None)} for i in range(3)]
    with pytest.raises(InputError) as caught:
        prepare(tmp_path, rows_, budget=BadRowBudget.parse("2"))
    assert caught.value.field == "--max-bad-rows"
    assert "3 bad rows" in str(caught.value) and "bad-0, bad-1, bad-2" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jpg", "set.json"]  # no OUT, no staging left
    assert prepare(tmp_path, rows_, budget=BadRowBudget.parse("25%"))["max_bad_rows"] == 3
    assert BadRowBudget.parse("0.1").limit(13) == 1 and BadRowBudget.parse("0").limit(100) == 0
    for text in ("abc", "1.5", "-1", "200%"):
        with pytest.raises(InputError, match="--max-bad-rows"):
            BadRowBudget.parse(text)


def test_overwrite_replaces_out_whole_and_never_a_folder_with_the_source(tmp_path):
    out = tmp_path / "set"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(InputError, match="--overwrite"):
        prepare(tmp_path, text_rows(5))
    assert prepare(tmp_path, text_rows(5), overwrite=True)["train"] == 5
    assert not (out / "old.txt").exists() and read_prepared(out) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set", "set.json"]
    src = out / "inside.json"
    src.write_text(json.dumps(text_rows(5)))
    with pytest.raises(InputError, match="source"):
        prepare_user_data(SourceSpec(format="llava", path=src), out, budget=BadRowBudget.parse("1"), overwrite=True)


# ---------------------------------------------------------------- parquet and WebDataset sources


def jpeg(size: tuple[int, int], seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (seed * 40 % 255, 80, 200)).save(buffer, format="JPEG")
    return buffer.getvalue()


def cooked(out: Path, split: str) -> list:
    """Every sample of `split` through Energon and the `conversation` cooker, as the loader reads it."""
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_val_dataset

    from vlmrun.data.cookers import energon_cookers

    class Cook(DefaultTaskEncoder):
        decoder = None  # raw bytes to the cooker, as our task encoders have it
        cookers = energon_cookers(["conversation"])

    workers = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(out, split_part=split, worker_config=workers, batch_size=None, task_encoder=Cook())
    return list(get_loader(dataset))


@pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")
def test_parquet_with_hugging_face_images_reads_back_through_the_cooker(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "img").mkdir()
    draw(tmp_path / "img" / "on-disk.png", (50, 30), 2)
    images = [[{"bytes": jpeg((32 + i, 24), i), "path": None}] for i in range(20)]
    images[3] = [{"bytes": None, "path": "img/on-disk.png"}]  # a struct with only a path
    images[4] = [{"bytes": jpeg((40, 40), 1), "path": None}, {"bytes": jpeg((20, 60), 2), "path": None}]
    images[5] = []  # text only
    whole = jpeg((64, 64), 6)
    images[6] = [{"bytes": whole[: len(whole) // 2], "path": None}]  # a JPEG cut short
    question = ["<image> How many?" if i != 4 else "<image> or <image>?" for i in range(20)]
    question[5] = "Is a cube round?"
    table = pa.table(
        {
            "qid": [f"q{i}" for i in range(20)],
            "image": images,
            "question": question,
            "answer": [str(i % 3) for i in range(20)],
            "part": ["val" if i % 5 == 0 else "train" for i in range(20)],
        }
    )
    (tmp_path / "data").mkdir()
    pq.write_table(table.slice(0, 12), tmp_path / "data" / "train-0.parquet")
    pq.write_table(table.slice(12), tmp_path / "data" / "train-1.parquet")
    spec = SourceSpec(
        format="parquet",
        path=tmp_path / "data",
        image_root=tmp_path,
        image_column="image",
        question_column="question",
        answer_column="answer",
        id_column="qid",
        split_column="part",
    )
    out = tmp_path / "set"
    summary = prepare_user_data(spec, out, budget=BadRowBudget.parse("1")).to_json()
    assert (summary["rows_read"], summary["train"], summary["val"]) == (20, 15, 4)
    assert (summary["images"], summary["text_only"]) == (19, 1)
    assert summary["bad_rows_by_reason"]["undecodable_image"]["rows"] == ["q6"]
    convs = {c.annotations["id"]: c for split in ("train", "val") for c in cooked(out, split)}
    assert len(convs) == 19
    assert tuple(media_pixels(convs["q3"], 0).shape) == (3, 30, 50)
    assert [tuple(media_pixels(convs["q4"], i).shape) for i in range(2)] == [(3, 40, 40), (3, 60, 20)]
    assert convs["q5"].media == [] and convs["q7"].answer == "1"
    assert {c.__key__.split("-")[0] for c in convs.values() if c.annotations["id"] in ("q0", "q5", "q10")} == {"val"}


def test_parquet_messages_column_and_missing_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [
        [{"role": "user", "content": "<image> How many?"}, {"role": "assistant", "content": "2"}],
        [{"from": "human", "value": "Color?"}, {"from": "gpt", "value": "red"}],
    ]
    pq.write_table(pa.table({"msgs": messages, "img": [jpeg((30, 30), 0), jpeg((28, 20), 1)]}), tmp_path / "m.parquet")
    spec = SourceSpec(format="parquet", path=tmp_path / "m.parquet", image_column="img", messages_column="msgs")
    summary = prepare_user_data(spec, tmp_path / "set", val_ratio=0, budget=BadRowBudget.parse("0")).to_json()
    assert (summary["train"], summary["images"], summary["bad_rows"]) == (2, 2, 0)
    record = json.loads(read_samples(tmp_path / "set", "train")["train-0000001"]["json"])
    assert record["id"] == "#1" and record["messages"][0]["content"][0] == {"type": "image", "ref": "0.jpg"}
    wrong = SourceSpec(format="parquet", path=tmp_path / "m.parquet", image_column="picture", messages_column="msgs")
    with pytest.raises(InputError, match="img, msgs") as caught:
        prepare_user_data(wrong, tmp_path / "other", budget=BadRowBudget.parse("0"))
    assert caught.value.field == "--image-column" and not (tmp_path / "other").exists()


def write_shard(path: Path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, parts in samples.items():
            for ext, data in parts.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_with_a_field_map(tmp_path):
    (tmp_path / "wds").mkdir()
    qa = {f"s{i:03d}": {"jpg": jpeg((36, 24), i), "txt": b"How many?", "answer.txt": str(i).encode()} for i in range(6)}
    del qa["s002"]["jpg"]  # text only
    write_shard(tmp_path / "wds" / "part-0.tar", qa)
    spec = SourceSpec(
        format="webdataset",
        path=tmp_path / "wds",
        fields={"image": "jpg", "question": "txt", "answer": "answer.txt"},
    )
    summary = prepare_user_data(spec, tmp_path / "qa", val_ratio=0, budget=BadRowBudget.parse("0")).to_json()
    assert (summary["rows_read"], summary["train"], summary["images"], summary["text_only"]) == (6, 6, 5, 1)
    record = json.loads(read_samples(tmp_path / "qa", "train")["train-0000003"]["json"])
    assert record["id"] == "s003" and record["messages"][1]["content"] == [{"type": "text", "text": "3"}]
    chats = {
        "c0": {"png": _png(), "json": json.dumps({"conversations": turns("<image> What?", "a box")}).encode()},
        "c1": {"json": json.dumps(turns("Hi", None)).encode()},
    }
    write_shard(tmp_path / "wds" / "part-1.tar", chats)
    spec = SourceSpec(format="webdataset", path=tmp_path / "wds", fields={"image": "jpg,png", "conversations": "json"})
    summary = prepare_user_data(spec, tmp_path / "chat", val_ratio=0, budget=BadRowBudget.parse("8")).to_json()
    assert summary["bad_rows_by_reason"]["no_assistant_turn"]["rows"] == ["c1"]
    assert summary["bad_rows_by_reason"]["malformed"]["count"] == 6  # the q/a shard has no json member
    with pytest.raises(InputError) as caught:
        prepare_user_data(
            SourceSpec(format="webdataset", path=tmp_path / "wds", fields={"image": "jpg"}),
            tmp_path / "x",
            budget=BadRowBudget.parse("0"),
        )
    assert caught.value.field == "--field"


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_flags_of_another_format_are_refused_naming_the_flag(tmp_path):
    src = tmp_path / "s.json"
    src.write_text(json.dumps(text_rows(2)))
    for spec, flag in [
        (SourceSpec(format="llava", path=src, image_column="image"), "--image-column"),
        (SourceSpec(format="llava", path=src, fields={"image": "jpg"}), "--field"),
        (SourceSpec(format="csv", path=src), "--format"),
        (SourceSpec(format="parquet", path=src, image_column="image"), "--messages-column"),
    ]:
        with pytest.raises(InputError) as caught:
            prepare_user_data(spec, tmp_path / "set", budget=BadRowBudget.parse("0"))
        assert caught.value.field == flag
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


@pytest.mark.slow
def test_the_tiny_recipe_trains_on_a_prepared_parquet_set(tmp_path):
    """The acceptance's parquet twin of the LLaVA set: a few hundred rows written with pyarrow (one and two
    images of several sizes as Hugging Face image structs, text only, broken rows), prepared by the CLI
    and trained on by the tiny recipe."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_: dict[str, list] = {"qid": [], "image": [], "question": [], "answer": []}

    def add(qid: str, images: list[bytes | None], question: str, answer: str) -> None:
        rows_["qid"].append(qid)
        rows_["image"].append([{"bytes": b, "path": None if b is not None else "gone.jpg"} for b in images])
        rows_["question"].append(question)
        rows_["answer"].append(answer)

    for i in range(240):
        size = SIZES[i % len(SIZES)]
        if i % 6 == 5:
            add(f"pair-{i}", [jpeg(size, i), jpeg(SIZES[(i + 1) % 6], i + 1)], "<image> or <image>?", "left")
        elif i % 6 == 4:
            add(f"text-{i}", [], "Is a cube round?", "no")
        else:
            add(f"one-{i}", [jpeg(size, i)], f"<image> {QUESTIONS[i % 3]}", str(i % 4))
    add("cut-jpeg", [jpeg((64, 64), 3)[:200]], "<image> How many?", "1")
    add("missing-path", [None], "<image> How many?", "1")
    add("no-answer", [jpeg((40, 40), 4)], "<image> How many?", "")
    src = tmp_path / "vqa.parquet"
    pq.write_table(pa.table(rows_), src)
    out = tmp_path / "set"
    columns = ["--image-column", "image", "--question-column", "question", "--answer-column", "answer"]
    done = vlmrun(
        "data",
        "prepare",
        str(src),
        str(out),
        "--format",
        "parquet",
        *columns,
        "--id-column",
        "qid",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    named = {row for info in summary["bad_rows_by_reason"].values() for row in info["rows"]}
    assert named == {"cut-jpeg", "missing-path", "no-answer"} and summary["rows_read"] == 243
    quick = ["train.max_steps=4", "checkpoint.save_period=2", "train.val_period=4", "train.val_samples=8"]
    extra = sets(f"data.path={out}", "data.num_workers=0", "logger.wandb_mode=disabled", "parallel.dp=1", *quick)
    run = tmp_path / "run"
    done = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), *extra, "--wait")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = rows(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in steps)
    assert math.isfinite(steps[-1]["val_loss"]) and sealed(run)[-1] == 4


# ---------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["int", "term", "hup"])
def test_a_signal_mid_conversion_leaves_no_partial_folder(tmp_path, signum):
    """Ctrl-C, `kill` and a closed terminal all stop `data prepare` with its half-written folder removed."""
    images = tmp_path / "images"
    images.mkdir()
    draw(images / "a.png", (64, 64), 1)
    many = [
        {"id": f"r{i}", "image": "images/a.png", "conversations": turns("<image> How many?", "2")} for i in range(20000)
    ]
    (tmp_path / "chat.json").write_text(json.dumps(many))
    out = tmp_path / "set"
    proc = subprocess.Popen(
        command(
            "data", "prepare", str(tmp_path / "chat.json"), str(out), "--format", "llava", "--samples-per-shard", "64"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob(".set.partial-*/train-*.tar")):  # writing its shards
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "images"], err[-2000:]
    assert "Traceback" not in err and signal.Signals(signum).name in err


# ---------------------------------------------------------------- the report's rows (issue 43, 9)


def test_an_integer_answer_column_is_written_as_its_digits_and_another_type_is_refused_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["How many?", "And now?"], "a": [3, 12]}), tmp_path / "ints.parquet")
    spec = SourceSpec(format="parquet", path=tmp_path / "ints.parquet", question_column="q", answer_column="a")
    summary = prepare_user_data(spec, tmp_path / "set", val_ratio=0, budget=BadRowBudget.parse("0")).to_json()
    assert (summary["train"], summary["bad_rows"]) == (2, 0)
    answers = [
        json.loads(s["json"])["messages"][1]["content"] for s in read_samples(tmp_path / "set", "train").values()
    ]
    assert answers == [[{"type": "text", "text": "3"}], [{"type": "text", "text": "12"}]]
    pq.write_table(pa.table({"q": ["How many?"], "a": [2.5]}), tmp_path / "floats.parquet")
    spec = SourceSpec(format="parquet", path=tmp_path / "floats.parquet", question_column="q", answer_column="a")
    with pytest.raises(InputError) as caught:
        prepare_user_data(spec, tmp_path / "other", budget=BadRowBudget.parse("0"))
    assert caught.value.field == "--answer-column" and "'a'" in str(caught.value) and "double" in str(caught.value)
    assert not (tmp_path / "other").exists()


LATIN1 = "Combien de pièces ?".encode("latin-1")


def test_text_that_is_not_utf8_is_refused_by_every_reader_naming_where(tmp_path):
    (tmp_path / "wds").mkdir()
    shard = {"s0": {"txt": b"How many?", "answer.txt": b"2"}, "s1": {"txt": LATIN1, "answer.txt": b"3"}}
    write_shard(tmp_path / "wds" / "part-0.tar", shard)
    spec = SourceSpec(format="webdataset", path=tmp_path / "wds", fields={"question": "txt", "answer": "answer.txt"})
    summary = prepare_user_data(spec, tmp_path / "w", val_ratio=0, budget=BadRowBudget.parse("1")).to_json()
    bad = summary["bad_rows_by_reason"]["not_utf8"]
    assert summary["train"] == 1 and bad["rows"] == ["s1"] and "s1.txt" in bad["first"] and "UTF-8" in bad["first"]
    chat = [{"id": "r0", "conversations": turns("Combien de pièces ?", "2")}]
    (tmp_path / "chat.json").write_bytes(json.dumps(chat, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(InputError) as caught:
        prepare_user_data(
            SourceSpec(format="llava", path=tmp_path / "chat.json"), tmp_path / "l", budget=BadRowBudget.parse("0")
        )
    assert caught.value.field == "src" and "not UTF-8" in str(caught.value) and "line 1" in str(caught.value)


def test_rows_in_the_chat_messages_format_are_read(tmp_path):
    (tmp_path / "images").mkdir()
    draw(tmp_path / "images" / "a.jpg", (40, 40), 1)
    rows_ = [
        {
            "id": "m0",
            "messages": [{"role": "user", "content": "<image> How many?"}, {"role": "assistant", "content": "2"}],
            "images": ["images/a.jpg"],
        },
        {
            "id": "m1",
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
                {"role": "assistant", "content": "red"},
            ],
            "image": "images/a.jpg",
        },
        {"id": "m2", "turns": [{"role": "user", "content": "Hi"}]},
    ]
    summary = prepare(tmp_path, rows_, val_ratio=0)
    assert (summary["train"], summary["images"]) == (2, 2)
    bad = summary["bad_rows_by_reason"]["malformed"]
    assert bad["rows"] == ["m2"] and "'conversations'" in bad["first"] and "'messages'" in bad["first"]
    assert "turns" in bad["first"]  # the keys the row has


def test_an_image_path_outside_the_image_root_is_refused_naming_the_row_and_path(tmp_path):
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    draw(src / "images" / "in.jpg", (40, 40), 1)
    draw(tmp_path / "secret.jpg", (40, 40), 2)
    rows_ = [
        {"id": "inside", "image": "images/in.jpg", "conversations": turns("<image> ?", "1")},
        {"id": "climbs", "image": "images/../../secret.jpg", "conversations": turns("<image> ?", "1")},
        {"id": "absolute", "image": str(tmp_path / "secret.jpg"), "conversations": turns("<image> ?", "1")},
        {"id": "absolute-inside", "image": str(src / "images" / "in.jpg"), "conversations": turns("<image> ?", "1")},
    ]
    summary = prepare(src, rows_, val_ratio=0)
    bad = summary["bad_rows_by_reason"]["image_outside_root"]
    assert summary["train"] == 2 and bad["rows"] == ["climbs", "absolute"]
    assert "images/../../secret.jpg" in bad["first"] and str(src) in bad["first"]
    (src / "abs.json").write_text(json.dumps(rows_[2:]))  # the absolute paths, under a wider --image-root
    wider = SourceSpec(format="llava", path=src / "abs.json", image_root=tmp_path)
    assert prepare_user_data(wider, tmp_path / "all", val_ratio=0, budget=BadRowBudget.parse("0")).data["train"] == 2
