"""The checkpoint store owns the layout: parts in, parts out, sealed atomically, verified, the newest wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vlmrun.algorithms.common.checkpoint import PARTS, CheckpointStore, part_file, verify

FORMAT1 = Path(__file__).resolve().parent / "fixtures" / "format1-run" / "checkpoints" / "step_9"


def _save(store: CheckpointStore, step: int, value: float = 1.0, *, parts=("controller", "model", "optimizer")) -> Path:
    pending = store.begin(step)
    files = {f: d for p in parts for f, d in pending.write(p, {"w": torch.full((100,), value)}).items()}
    files |= pending.write("rng", {"seed": step}, index=0)
    return store.finish(pending, files, {"placement_hash": "h"})


def test_parts_round_trip_under_the_stores_names(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep=1), 5, 2.5)
    found, skipped = CheckpointStore(tmp_path, keep=1).latest()
    assert found.path == path and found.step == 5 and not skipped
    assert torch.equal(found.read("model")["w"], torch.full((100,), 2.5))
    assert found.read("rng", index=0) == {"seed": 5}
    assert found.manifest["placement_hash"] == "h" and found.format == 2
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
    assert found.step == 9 and not skipped and store.newest_step() == 9


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
    assert manifest["step"] == 5 and manifest["format"] == 2
    entry = manifest["files"][PARTS["model"]]
    assert entry["size"] == (path / PARTS["model"]).stat().st_size and len(entry["sha256"]) == 64


def test_format1_checkpoint_written_by_the_previous_layout_reads_through_the_same_parts(tmp_path):
    shutil.copytree(FORMAT1, tmp_path / "step_9")
    found, skipped = CheckpointStore(tmp_path, keep=2).latest()
    assert found.step == 9 and found.format == 1 and not skipped
    assert set(found.read("optimizer")) == {"optimizer", "scheduler"}
    assert "model.language_model.embed_tokens.weight" in found.read("model")
    assert found.read("loader", index=1)["fingerprint"]["topology.shard"] == 1
    assert found.read("plane", index=0) == {}
    assert set(found.read("controller")) == {"rng", "counters"}
    assert found.manifest["placement_hash"] and found.read("rng", index=1)["torch"].dtype == torch.uint8


def test_unknown_format_is_refused_naming_it(tmp_path):
    path = _save(CheckpointStore(tmp_path, keep=1), 1)
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(m | {"format": 7}))
    found, skipped = CheckpointStore(tmp_path, keep=1).latest()
    assert found is None and "format 7" in skipped[0] and "formats 1 and 2" in skipped[0]
