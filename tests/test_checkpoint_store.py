"""The checkpoint store owns the layout: parts in, parts out, sealed atomically, verified, the newest wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vlmrun.checkpoint import files as checkpoint_files
from vlmrun.checkpoint.manifest import CorruptCheckpoint, Manifest, RunAtSave
from vlmrun.checkpoint.parts import PARTS, part_file
from vlmrun.checkpoint.read import verify
from vlmrun.checkpoint.store import CheckpointStore, MissingCheckpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FORMAT1 = FIXTURES / "format1-run" / "checkpoints" / "step_9"


def _save(store: CheckpointStore, step: int, value: float = 1.0, *, parts=("controller", "model", "optimizer")) -> Path:
    """A checkpoint of `parts` (the controller's as JSON, the others' tensors) and rank 0's RNG."""
    pending = store.begin(step)
    state = {p: {"w": value} if p == "controller" else {"w": torch.full((100,), value)} for p in parts}
    files = {f: d for p in parts for f, d in pending.write(p, state[p]).items()}
    files |= pending.write("rng", {"seed": step}, index=0)
    return store.finish(pending, files, RunAtSave(placement_hash="h", layout="dp=1"))


def _as_format3(path: Path) -> None:
    """The checkpoint at `path` rewritten as format 3 wrote it: the controller's part in torch's format."""
    manifest = json.loads((path / "manifest.json").read_text())
    controller = json.loads((path / "controller.json").read_text())
    (path / "controller.json").unlink()
    torch.save(controller, path / "controller.pt")
    del manifest["files"]["controller.json"]
    manifest["files"]["controller.pt"] = checkpoint_files.digest(path / "controller.pt").to_json()
    (path / "manifest.json").write_text(json.dumps(manifest | {"format": 3}))


def test_parts_round_trip_under_the_stores_names(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep=1), 5, 2.5)
    found, skipped = CheckpointStore(tmp_path, keep=1).latest()
    assert found.path == path and found.step == 5 and not skipped
    assert torch.equal(found.read("model")["w"], torch.full((100,), 2.5))
    assert found.read("rng", index=0) == {"seed": 5}
    assert found.read("controller") == {"w": 2.5} and json.loads((path / "controller.json").read_text()) == {"w": 2.5}
    assert found.manifest.run.placement_hash == "h" and found.format == 4
    assert (path / PARTS["model"]).is_file() and (path / part_file("rng", 0)).is_file()
    assert not found.has("loader", index=0)
    with pytest.raises(KeyError, match="loader"):
        found.read("loader", index=0)


def test_unknown_part_or_missing_index_is_a_bug_not_a_file(tmp_path):
    pending = CheckpointStore(tmp_path, keep=1).begin(1)
    with pytest.raises(ValueError, match="unknown checkpoint part"):
        pending.write("weights", {})
    with pytest.raises(ValueError, match="needs index"):
        pending.write("loader", {})


def test_retention_and_newest_wins(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (3, 6, 9):
        _save(store, step)
    assert [s for s, _ in store.complete()] == [6, 9]
    found, skipped = store.latest()
    assert found.step == 9 and not skipped


@pytest.mark.parametrize("damage", ["delete_manifest", "truncate", "flip", "bad_json", "drop_part", "no_files"])
def test_torn_corrupt_or_incomplete_checkpoint_is_reported_and_skipped(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 2)
    newest = _save(store, 4)
    model = newest / PARTS["model"]
    manifest = newest / "manifest.json"
    if damage == "delete_manifest":
        manifest.unlink()
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:10])
    elif damage == "flip":
        model.write_bytes(b"y" + model.read_bytes()[1:])
    elif damage == "bad_json":
        manifest.write_text("{not json")
    else:  # a manifest that does not list a part every checkpoint needs is not a checkpoint
        m = json.loads(manifest.read_text())
        m["files"] = {} if damage == "no_files" else {k: v for k, v in m["files"].items() if k != PARTS["optimizer"]}
        manifest.write_text(json.dumps(m))
    found, skipped = store.latest()
    assert found.step == 2
    assert len(skipped) == 1 and "step_4" in skipped[0]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"step": "4"}, "the manifest's step is '4', not an integer"),
        ({"files": []}, "the manifest's files is [], not an object"),
        (
            {"files": {"controller.json": {"size": 3, "md5": "ab"}}},
            "entry of controller.json is not a size and a checksum",
        ),
        ({"files": {"controller.json": {"xxh3_128": "ab"}}}, "entry of controller.json is not a size and a checksum"),
    ],
)
def test_a_malformed_manifest_is_skipped_naming_what_is_wrong(tmp_path, change, words):
    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 2)
    manifest = _save(store, 4) / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | change))
    found, skipped = store.latest()
    assert found.step == 2 and len(skipped) == 1 and words in skipped[0]


def test_a_checkpoint_without_the_required_parts_is_never_sealed(tmp_path):
    store = CheckpointStore(tmp_path, keep=1)
    with pytest.raises(ValueError, match="optimizer"):
        _save(store, 1, parts=("controller", "model"))
    assert store.complete() == []


def test_unfinished_tmp_checkpoint_is_ignored_and_cleaned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 1)
    pending = store.begin(2)
    pending.write("model", {"partial": True})
    assert store.latest()[0].step == 1
    _save(store, 3)
    assert not Path(pending.path).exists()


def test_manifest_records_sizes_and_checksums(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep=1), 5)
    manifest = verify(path)
    assert manifest.step == 5 and manifest.format == 4
    entry = json.loads((path / "manifest.json").read_text())["files"][PARTS["model"]]
    assert entry["size"] == (path / PARTS["model"]).stat().st_size and len(entry["xxh3_128"]) == 32


def test_a_format_2_checkpoint_with_sha256_checksums_still_verifies_and_damage_is_still_seen(tmp_path):
    """Checkpoints written before XXH3 (format 2) resume: their sha256 entries are checked as they are."""
    import hashlib

    path = _save(CheckpointStore(tmp_path, keep=1), 5)
    _as_format3(path)
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        manifest["files"][name] = {
            "size": entry["size"],
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
    (path / "manifest.json").write_text(json.dumps(manifest | {"format": 2}))
    assert verify(path).format == 2
    data = bytearray((path / PARTS["model"]).read_bytes())
    data[-30] ^= 0xFF
    (path / PARTS["model"]).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        verify(path)


def test_a_format_3_checkpoint_with_the_controllers_part_in_torchs_format_still_reads(tmp_path):
    """Checkpoints written before the controller's part became JSON (format 3) resume: it is read through
    torch; a format 3 checkpoint without it is incomplete, as ever."""
    path = _save(CheckpointStore(tmp_path, keep=1), 5, 2.5)
    _as_format3(path)
    found, skipped = CheckpointStore(tmp_path, keep=1).latest()
    assert found.step == 5 and found.format == 3 and not skipped
    assert found.read("controller") == {"w": 2.5} and not (path / "controller.json").exists()
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["controller.pt"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpoint, match="lists no controller part"):
        verify(path)


def test_format1_checkpoint_written_by_the_previous_layout_reads_through_the_same_parts(tmp_path):
    shutil.copytree(FORMAT1, tmp_path / "step_9")
    found, skipped = CheckpointStore(tmp_path, keep=2).latest()
    assert found.step == 9 and found.format == 1 and not skipped
    assert set(found.read("optimizer")) == {"optimizer", "scheduler"}
    assert "model.language_model.embed_tokens.weight" in found.read("model")
    assert found.read("loader", index=1)["fingerprint"]["topology.shard"] == 1
    assert found.read("plane", index=0) == {}
    assert set(found.read("controller")) == {"rng", "counters"}
    assert found.manifest.run.placement_hash and found.read("rng", index=1)["torch"].dtype == torch.uint8


@pytest.mark.parametrize("fmt, checksum", [(1, "sha256"), (2, "sha256"), (3, "xxh3_128")])
def test_each_older_formats_checkpoint_written_by_its_vlmrun_reads_through_the_same_parts(tmp_path, fmt, checksum):
    """The fixtures of tests/test_old_formats_resume.py (each written by the vlmrun of its format): every
    part reads back through the current calls, the manifest parses into its typed form, and a damaged
    file is still seen under the checksum that format recorded."""
    shutil.copytree(FIXTURES / f"format{fmt}-run" / "checkpoints" / "step_9", tmp_path / "step_9")
    found, skipped = CheckpointStore(tmp_path, keep=2).latest()
    assert (found.step, found.format, skipped) == (9, fmt, [])
    assert {e.algorithm for e in found.manifest.files.values()} == {checksum}
    assert found.manifest.run.layout == "dp=2 tp=1 pp=1 cp=1 (2 ranks)" and found.manifest.run.counters
    assert found.manifest.run.placement_hash and (found.manifest.run_id is None) == (fmt == 1)
    assert set(found.read("optimizer")) == {"optimizer", "scheduler"}
    assert "model.language_model.embed_tokens.weight" in found.read("model")
    assert found.read("loader", index=1)["fingerprint"]["topology.shard"] == 1
    assert not found.has("plane", index=0) or found.read("plane", index=0) == {}
    controller = found.read("controller")
    assert set(controller) == {"rng", "counters"} and "python" in controller["rng"]
    assert controller["counters"]["consumed_samples"] == 72
    assert found.read("rng", index=1)["torch"].dtype == torch.uint8
    model = next(name for name in found.manifest.files if name.endswith("model.pt"))
    data = bytearray((tmp_path / "step_9" / model).read_bytes())
    data[-30] ^= 0xFF
    (tmp_path / "step_9" / model).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        verify(tmp_path / "step_9")


def test_unknown_format_is_refused_naming_it(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep=1), 1)
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(m | {"format": 7}))
    found, skipped = CheckpointStore(tmp_path, keep=1).latest()
    assert found is None and "format 7" in skipped[0] and "formats 1, 2, 3, 4" in skipped[0]


# ---- damaged checkpoints: moved aside, never counted, the step saved again ------------------------------
def _damage(path: Path) -> None:
    model = path / PARTS["model"]
    model.write_bytes(b"y" + model.read_bytes()[1:])


def test_the_job_moves_a_damaged_newest_aside_and_saves_its_step_again(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 2)
    _damage(_save(store, 4))
    attempt = CheckpointStore(tmp_path, keep=2)  # the next attempt's store
    found, skipped = attempt.latest(set_aside=True)
    assert found.step == 2 and len(skipped) == 1
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("damaged_step_4-")]
    assert len(aside) == 1 and aside[0] in skipped[0] and "checksum mismatch" in skipped[0]
    assert [s for s, _ in attempt.complete()] == [2]  # kept for inspection, never counted again
    assert not attempt.holds(4)
    _save(attempt, 3)
    _save(attempt, 4)  # the step the damaged one held, saved again
    assert [s for s, _ in attempt.complete()] == [3, 4] and verify(tmp_path / "step_4").step == 4


def test_retention_counts_valid_checkpoints_only_and_keeps_the_last_valid_one(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 2)
    _damage(_save(store, 4))
    _save(CheckpointStore(tmp_path, keep=2), 6)  # a store that never looked: retention verifies step_4
    assert [s for s, _ in CheckpointStore(tmp_path, keep=2).complete()] == [2, 6]
    assert verify(tmp_path / "step_2") and any(p.name.startswith("damaged_step_4-") for p in tmp_path.iterdir())


def test_a_reader_reports_a_damaged_newest_and_moves_nothing(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 2, 2.0)
    _damage(_save(store, 4))
    with CheckpointStore(tmp_path, keep=3).reading() as (found, skipped):
        assert found.step == 2 and torch.equal(found.read("model")["w"], torch.full((100,), 2.0))
        assert len(skipped) == 1 and "step_4" in skipped[0] and "moved" not in skipped[0]
    assert (tmp_path / "step_4").is_dir()
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        with CheckpointStore(tmp_path, keep=3).reading(4):
            pass
    with pytest.raises(MissingCheckpoint, match="no checkpoint of step 3"):
        with CheckpointStore(tmp_path, keep=3).reading(3):
            pass


def test_a_sealed_checkpoint_counts_as_valid_without_a_rehash_until_a_stat_says_otherwise(tmp_path, monkeypatch):
    from vlmrun.checkpoint import files as checkpoint_files

    hashed: list[str] = []
    real = checkpoint_files.file_checksum
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 1)
    writers = store.begin

    def counted_finish(step):
        pending = writers(step)
        files = {f: d for p in ("controller", "model", "optimizer") for f, d in pending.write(p, {"w": 1}).items()}
        monkeypatch.setattr(checkpoint_files, "file_checksum", lambda p, *a: hashed.append(p.name) or real(p, *a))
        store.finish(pending, files, None)
        monkeypatch.setattr(checkpoint_files, "file_checksum", real)

    for step in (2, 3, 4, 5):
        counted_finish(step)
    assert hashed == []  # retention re-read nothing this store sealed
    assert store.holds(5)
    (tmp_path / "step_5" / PARTS["model"]).write_bytes(b"short")
    assert not store.holds(5)  # a truncated file is seen by the stat: the step is saved again


def test_a_checkpoint_being_read_outlives_retention_and_goes_at_a_later_save(tmp_path):
    writer = CheckpointStore(tmp_path, keep=1)
    _save(writer, 1, 1.0)
    with CheckpointStore(tmp_path, keep=1).reading() as (found, _):
        _save(writer, 2, 2.0)
        _save(writer, 3, 3.0)
        assert found.step == 1 and (tmp_path / "step_1").is_dir()
        assert torch.equal(found.read("model")["w"], torch.full((100,), 1.0))
    _save(writer, 4, 4.0)
    assert [s for s, _ in writer.complete()] == [4]


def test_a_checkpoint_held_past_retention_goes_as_its_reader_lets_go_or_at_the_runs_end(tmp_path):
    from vlmrun.checkpoint.lease import shared_hold

    writer = CheckpointStore(tmp_path, keep=1)
    _save(writer, 1, 1.0)
    with CheckpointStore(tmp_path, keep=1).reading() as (found, _):
        _save(writer, 2, 2.0)
        assert [s for s, _ in writer.complete()] == [1, 2]  # held: kept for now
    assert [s for s, _ in writer.complete()] == [2]  # its reader let go: keep 1 holds again
    with shared_hold(tmp_path / "step_2"):  # a reader that never lets go itself (killed: its lock ends with it)
        _save(writer, 3, 3.0)
        writer.delete_expired()
        assert [s for s, _ in writer.complete()] == [2, 3]
    writer.delete_expired()  # the run's end
    assert [s for s, _ in writer.complete()] == [3]


def test_readers_racing_a_writer_with_keep_1_always_read_a_whole_checkpoint(tmp_path):
    import threading
    import time

    writer = CheckpointStore(tmp_path, keep=1)
    _save(writer, 1, 1.0)
    done, errors, reads = threading.Event(), [], []

    def write():
        for step in range(2, 80):
            _save(writer, step, float(step))
        done.set()

    def read():
        reader = CheckpointStore(tmp_path, keep=1)
        while not done.is_set():
            try:
                with reader.reading() as (found, skipped):
                    value = found.read("model")["w"][0].item()
                    assert value == found.step and not skipped, (value, found.step, skipped)
                    reads.append(found.step)
            except Exception as e:  # noqa: BLE001 - the test reports every failure of a reader
                errors.append(repr(e))
            time.sleep(0.002)  # a reader a few times per save, not a spin that starves the writer

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(reads) > 10
    left = [s for s, _ in writer.complete()]
    assert left[-1] == 79 and len(left) <= 1 + 3  # at most one held back per reader, until the next save


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_writers_hash_what_they_write_as_it_goes_out_and_read_no_file_back(tmp_path, monkeypatch):
    from vlmrun.checkpoint import files as checkpoint_files
    from vlmrun.checkpoint.parts import PolicyState, Storage

    real = checkpoint_files.file_checksum

    def no_read_back(path, *algorithm):
        raise AssertionError(f"{path} was read back to be hashed")

    pending = CheckpointStore(tmp_path, keep=1).begin(1)
    monkeypatch.setattr(checkpoint_files, "file_checksum", no_read_back)
    files = pending.write("controller", {"counters": {"n": 3}})
    files |= pending.write("rng", {"w": torch.randn(300, 70), "n": 3}, index=0)
    one_copy = PolicyState(Storage.REPLICATED, {"model": {"w": torch.randn(50)}, "optimizer": {"lr": 0.1}})
    files |= pending.write_policy(one_copy, rank=0)
    shards = PolicyState(Storage.SHARDED, {"model": {"w": torch.randn(64, 64)}, "optimizer": {"s": torch.ones(9)}})
    dcp_files = pending.write_policy(shards, rank=0)  # DCP, one process: its shard file and .metadata
    monkeypatch.setattr(checkpoint_files, "file_checksum", real)
    assert any(f.endswith(".distcp") for f in dcp_files) and any(f.endswith(".metadata") for f in dcp_files)
    for name, recorded in (files | dcp_files).items():
        assert recorded == checkpoint_files.digest(Path(pending.path) / name), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_files_skip_the_zip_crc_and_load_and_other_saves_keep_it(tmp_path):
    """Checkpoint files carry no zip CRC32 (the manifest's checksum covers them), one part's or DCP's,
    and load as written; a `torch.save` outside a checkpoint write, on another thread or after it, keeps
    its CRC32."""
    import threading
    import zipfile

    from vlmrun.checkpoint import files as checkpoint_files
    from vlmrun.checkpoint import read as checkpoint_read
    from vlmrun.checkpoint.parts import PolicyState, Storage

    pending = CheckpointStore(tmp_path, keep=1).begin(1)
    part = {"w": torch.randn(256, 256), "n": 3}
    files = pending.write("rng", part, index=0)
    shards = PolicyState(Storage.SHARDED, {"model": {"w": torch.randn(64, 64)}, "optimizer": {"s": torch.ones(9)}})
    files |= pending.write_policy(shards, rank=0)
    with zipfile.ZipFile(Path(pending.path) / part_file("rng", 0)) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    found = checkpoint_read.Checkpoint(1, Path(pending.path), Manifest(4, 1, files))
    assert torch.equal(found.read("rng", index=0)["w"], part["w"])
    into = PolicyState(Storage.SHARDED, {"model": {"w": torch.zeros(64, 64)}, "optimizer": {"s": torch.zeros(9)}})
    assert torch.equal(found.read_policy(into).parts["model"]["w"], shards.parts["model"]["w"])

    seen = []  # what a thread's torch.save gets while this thread is inside a checkpoint write
    with checkpoint_files.without_zip_crc():
        other = threading.Thread(target=lambda: seen.append(torch.serialization.get_crc32_options()))
        other.start()
        other.join(30)
        assert not torch.serialization.get_crc32_options()
    assert seen == [True] and torch.serialization.get_crc32_options()
    torch.save({"w": torch.ones(10)}, tmp_path / "users.pt")
    with zipfile.ZipFile(tmp_path / "users.pt") as z:
        assert all(i.CRC != 0 for i in z.infolist() if i.file_size)


def test_verify_hashes_on_several_threads_and_names_the_first_damaged_file_in_manifest_order(tmp_path, monkeypatch):
    import threading
    import time

    from vlmrun.checkpoint import files as checkpoint_files
    from vlmrun.checkpoint import read as checkpoint_read

    path = _save(CheckpointStore(tmp_path, keep=1), 1, parts=("controller", "model", "optimizer"))
    threads, real = set(), checkpoint_files.file_checksum
    monkeypatch.setattr(checkpoint_read, "_HASH_THREADS", 4)

    def slow_hash(p, *algorithm):  # long enough that the pool starts a thread per file
        threads.add(threading.get_ident())
        time.sleep(0.05)
        return real(p, *algorithm)

    monkeypatch.setattr(checkpoint_files, "file_checksum", slow_hash)
    verify(path)
    assert len(threads) > 1  # the four files were hashed by more than one thread
    for name in (PARTS["optimizer"], PARTS["model"]):  # same size, other bytes: only a checksum sees it
        data = bytearray((path / name).read_bytes())
        data[-30] ^= 0xFF
        (path / name).write_bytes(bytes(data))
    first = min(
        (PARTS["optimizer"], PARTS["model"]), key=list(json.loads((path / "manifest.json").read_text())["files"]).index
    )
    with pytest.raises(CorruptCheckpoint, match=f"{first} checksum mismatch"):
        verify(path)
