"""The files of a checkpoint: each one's checksum taken as its bytes go out, and the seal that makes them durable.

- A writer hashes what it writes on its way to the file (`HashingStream`; DCP's writes through
  `hashing_file_system`), so no file is read back to be hashed. `digest` of a file is its size and its
  checksum under `CHECKSUM`, the key the manifest records it with.
- The checksum is XXH3-128: fast enough that a save costs its writes, not its hashing, and a resume's
  verify reads at the storage's pace. It guards against damage (a torn write, a flipped bit, a file
  another save replaced), not against someone who forges a file to match. Older manifests recorded
  sha256 (legacy.py); `file_checksum` reads either, by the key an entry has.
- `seal` writes the manifest and fsyncs every file and folder: what a rename then publishes is on disk.
  The writers leave their bytes in the page cache, as a plain `torch.save` does; the seal waits for the
  disk, and the step loop runs it behind the next steps (saving.py).
- A write that fails for want of space raises NoSpaceLeft (vlmrun.errors) naming the file, what its
  file system had free and what the write needed (`space_named`), wherever it fails: `torch.save`'s own
  error ("unexpected pos ...") hides the ENOSPC it met, DCP's wraps it in a CheckpointException.
- `torch.save` into a checkpoint skips the zip format's CRC32 of every record (`without_zip_crc`): the
  manifest's checksum covers every byte of every file, and the CRC32 pass costs as much as the write
  (docs/measurements.md). `torch.load` reads such files as any other.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from vlmrun.checkpoint.legacy import CHECKSUMS as _OLDER_CHECKSUMS
from vlmrun.errors import NoSpaceLeft, disk_full, no_space_left

#: The checksum new checkpoints record per file (manifest entry: {"size": n, CHECKSUM: hex digest}).
CHECKSUM = "xxh3_128"
#: Every checksum a manifest entry may carry, by its key, the current one first.
ALGORITHMS = {CHECKSUM: xxhash.xxh3_128, **_OLDER_CHECKSUMS}


@dataclass(frozen=True)
class Digest:
    """A file's size and checksum under `algorithm`, as the manifest records it: {"size": n, algorithm: hex}."""

    size: int
    checksum: str
    algorithm: str = CHECKSUM

    @classmethod
    def from_json(cls, entry: object) -> Digest | None:
        """The digest a manifest entry records; None when it is not one (no size, or no checksum vlmrun knows)."""
        if not isinstance(entry, dict) or type(entry.get("size")) is not int:
            return None
        algorithm = next((a for a in ALGORITHMS if isinstance(entry.get(a), str)), None)
        return None if algorithm is None else cls(entry["size"], entry[algorithm], algorithm)

    def to_json(self) -> dict:
        return {"size": self.size, self.algorithm: self.checksum}


_CHUNK = 8 << 20  # bytes per read while hashing a file on disk


class HashingStream(io.RawIOBase):
    """A write-only stream over `raw` that hashes every byte on its way out: the writer's digest
    without reading the file back. Position queries pass through (DCP records offsets)."""

    def __init__(self, raw):
        self.raw, self._hash, self.size = raw, ALGORITHMS[CHECKSUM](), 0

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

    def digest(self) -> Digest:
        return Digest(self.size, self._hash.hexdigest())


@contextlib.contextmanager
def without_zip_crc():
    """`torch.save` in the block skips the zip records' CRC32 (see the module doc). torch keeps that switch per
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
    (see the module doc)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self):
            self.digests: dict[Path, Digest] = {}

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


@contextlib.contextmanager
def space_named(path: Path, needed: Callable[[], int | None]) -> Iterator[None]:
    """A write in the block that fails for want of space raises NoSpaceLeft naming `path` and
    `needed()` (bytes the write needed, asked only then); any other error passes as it is."""
    try:
        yield
    except NoSpaceLeft:
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if disk_full(e) is None:
            raise
        raise no_space_left(path, needed()) from e


def state_bytes(value: Any) -> int:
    """The bytes the tensors and arrays in `value` (nested dicts, lists, tuples) hold: about what
    `torch.save` writes of it (of a DTensor, this rank's shard)."""
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    if hasattr(value, "to_local"):
        value = value.to_local()
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.numel() * value.element_size()
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    nbytes = getattr(value, "nbytes", 0)  # numpy
    return nbytes if isinstance(nbytes, int) else 0


def file_checksum(path: Path, algorithm: str = CHECKSUM) -> str:
    """The checksum of the file at `path` under `algorithm`, read in full (the read drops the GIL, and
    so does hashing a large chunk: callers hash several files on threads at once)."""
    h = ALGORITHMS[algorithm]()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(path: Path) -> Digest:
    """The digest of a file on disk (read in full)."""
    return Digest(path.stat().st_size, file_checksum(path))


def seal(folder: Path, manifest: dict, manifest_name: str) -> None:
    """Write `manifest` into `folder` as `manifest_name` and fsync every file and folder in it: what a
    rename then publishes is on disk whole."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    with space_named(folder / manifest_name, lambda: len(text)), open(folder / manifest_name, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            # a file system that allocates late (ext4, XFS, NFS) says ENOSPC here, not at the write
            with space_named(p, lambda p=p: p.stat().st_size), open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
