"""The fingerprint of what model.path holds: other weights at the same path differ, a copy of the same
weights does not, and it reads a few blocks of a large file rather than all of it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlmrun.models import fingerprint
from vlmrun.models.fingerprint import BLOCK, SAMPLES, SMALL_FILE, directory_fingerprint


def test_two_tiny_models_of_other_seeds_differ_and_a_copy_does_not(tmp_path, tiny_dirs):
    from vlmrun.models.tiny import ensure_tiny_model

    seed0 = Path(tiny_dirs["qwen2_5_vl"])
    seed1 = ensure_tiny_model("qwen2_5_vl", tmp_path / "models", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(seed0, copy, copy_function=shutil.copyfile)  # new mtimes, same bytes
    (copy / ".cache").mkdir()
    (copy / ".cache" / "download.lock").write_text("hub metadata, never loaded")
    assert directory_fingerprint(copy) == directory_fingerprint(seed0) != directory_fingerprint(seed1)
    assert directory_fingerprint(seed0).startswith(f"{len(list(seed0.iterdir()))} files, ")


def test_a_renamed_added_or_edited_small_file_changes_it(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    before = directory_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    edited = directory_fingerprint(tmp_path)
    (tmp_path / "config.json").rename(tmp_path / "config2.json")
    renamed = directory_fingerprint(tmp_path)
    (tmp_path / "extra.txt").write_text("x")
    assert len({before, edited, renamed, directory_fingerprint(tmp_path)}) == 4


def test_a_large_file_is_sampled_not_read_whole(tmp_path, monkeypatch):
    weights = tmp_path / "model.safetensors"
    size = SMALL_FILE * 4
    with open(weights, "wb") as f:
        f.truncate(size)  # sparse: cheap to make, every byte zero
    read: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            self.f.seek(offset)

        def read(self, n):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(fingerprint, "open", lambda p, mode: Counting(real_open(p, mode)), raising=False)
    before = directory_fingerprint(tmp_path)
    assert sum(read) == SAMPLES * BLOCK < size // 30
    with open(weights, "r+b") as f:  # a change inside a sampled block (the middle one) is seen
        f.seek((size - BLOCK) * (SAMPLES // 2) // (SAMPLES - 1))
        f.write(b"\x01" * 16)
    edited = directory_fingerprint(tmp_path)
    os.truncate(weights, size - 1)  # and so is a change of size
    assert len({before, edited, directory_fingerprint(tmp_path)}) == 3
