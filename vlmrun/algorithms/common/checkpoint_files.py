"""The files of a checkpoint: each one's checksum taken as its bytes go out, and the seal that makes them durable.

1. A writer hashes what it writes on its way to the file (`HashingStream`; DCP's writes through
   `hashing_file_system`), so no file is read back to be hashed. `digest` of a file is its size and
   its checksum under `CHECKSUM`, the one key the manifest records it with.
2. The checksum is XXH3-128 (`xxhash`): ~25 GB/s on one core here, against ~1.8 GB/s for sha256 with
   the CPU's SHA instructions (0.8 GB/s on another host of this kind), so the save's cost is its
   writes, not its hashing, and a resume's verify reads at the storage's pace. It guards against
   damage (a torn write, a flipped bit, a file another save replaced), not against someone who
   forges a file to match: 128 bits make an accidental match impossible in practice. Checkpoints of
   format 2 recorded sha256; `file_checksum` reads either, by the key an entry has (`recorded`).
3. `seal` writes the manifest and fsyncs every file and folder: what a rename then publishes is on
   disk. The writers leave their bytes in the page cache, as a plain `torch.save` does; the seal waits
   for the disk, and the step loop runs it behind the next steps (saving.py).
4. `torch.save` into a checkpoint skips the zip format's CRC32 of every record (`without_zip_crc`):
   the manifest's XXH3-128 covers every byte of every file, and the CRC32 pass cost as much as the
   write itself (docs/measurements.md). `torch.load` reads such files as any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import xxhash

#: The checksum new checkpoints record per file (manifest entry: {"size": n, CHECKSUM: hex digest}).
CHECKSUM = "xxh3_128"
#: Every checksum a manifest entry may carry, newest first: format 3 writes xxh3_128, format 2 wrote sha256.
_ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_CHUNK = 8 << 20  # bytes per read while hashing a file on disk


class HashingStream(io.RawIOBase):
    """A write-only stream over `raw` that hashes every byte on its way out: the writer's digest
    without reading the file back. Position queries pass through (DCP records offsets)."""

    def __init__(self, raw):
        self.raw, self._hash, self.size = raw, _ALGORITHMS[CHECKSUM](), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n  # a buffered file writes everything or raises
        self._hash.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        if not self.raw.closed:  # IOBase's finalizer flushes again, after `raw` was closed
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def digest(self) -> dict:
        return {"size": self.size, CHECKSUM: self._hash.hexdigest()}


@contextlib.contextmanager
def without_zip_crc():
    """`torch.save` in the block skips the zip records' CRC32 (module doc, 4). torch keeps that switch per
    thread (a context variable): a write on another thread, a user's `torch.save`, keeps its CRC32."""
    import torch

    if not hasattr(torch.serialization, "set_crc32_options"):  # a torch without the switch computes it always
        yield
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@contextlib.contextmanager
def hashing_writes(raw):
    """A `HashingStream` over the open file `raw` for one checkpoint file's writes, `torch.save` in the
    block without the zip CRC32; at the end the file is flushed."""
    with without_zip_crc():
        yield HashingStream(raw)
    raw.flush()


def hashing_file_system():
    """DCP's local file system, with every file it writes hashed as it goes (`digests`: path -> digest,
    following DCP's renames of its metadata file) and its tensors' `torch.save` without the zip CRC32
    (module doc, 4)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self):
            self.digests: dict[Path, dict] = {}

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw, hashing_writes(raw) as hashed:
                yield hashed
            self.digests[Path(path)] = hashed.digest()

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            if Path(path) in self.digests:
                self.digests[Path(new_path)] = self.digests.pop(Path(path))

    return HashingFileSystem()


def recorded(entry: dict) -> tuple[str, str | None]:
    """(algorithm, checksum) a manifest entry records: its CHECKSUM, or a format-2 entry's sha256."""
    algorithm = next((name for name in _ALGORITHMS if name in entry), CHECKSUM)
    return algorithm, entry.get(algorithm)


def file_checksum(path: Path, algorithm: str = CHECKSUM) -> str:
    """The checksum of the file at `path` under `algorithm`, read in full (the read drops the GIL, and
    so does hashing a large chunk: callers hash several files on threads at once)."""
    h = _ALGORITHMS[algorithm]()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(path: Path) -> dict:
    """{size, CHECKSUM} of a file on disk, as the manifest records it (read in full)."""
    return {"size": path.stat().st_size, CHECKSUM: file_checksum(path)}


def seal(folder: Path, manifest: dict, manifest_name: str) -> None:
    """Write `manifest` into `folder` as `manifest_name` and fsync every file and folder in it: what a
    rename then publishes is on disk whole."""
    with open(folder / manifest_name, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
