"""What crosses between a rank and its vllm engine process: refit buckets through shared memory, as plain data.

The two processes run different torch releases (the project's and the one vLLM pins), so nothing goes
across as a pickled tensor: a bucket of the policy's weights is copied into one shared segment and
described by a `BucketMessage` of plain values (each tensor's name, dtype name, shape and byte offset),
which the engine turns back into tensors over the same memory without a copy.

1. On the host (`HostSegment`): a file in /dev/shm that both processes map (`torch.from_file`, shared).
   The rank unlinks it as soon as the engine has mapped it, so a killed run leaves nothing behind; a
   larger bucket gets a fresh file. One bucket of host memory beyond the engine's weights.
2. On a GPU (`CudaSegment`): one device buffer from a plain cudaMalloc block (`classic_buffer`), shared
   through the CUDA IPC handle of its storage (torch's `_share_cuda_` / `_new_shared_cuda`, the pair
   torch.multiprocessing uses; the same in both torch releases): no trip through the host. One bucket
   of device memory beyond the engine's weights.
3. The engine side (`EngineSegments`) maps the segment a message names and yields (name, tensor) views;
   the rank writes the next bucket only after the engine's call for this one has returned (on a GPU the
   engine waits for its copies to finish before it returns).

Standard library and torch only: the engine's environment imports this module too.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Each tensor starts at a multiple of this many bytes (every dtype's alignment, and the GPU's).
ALIGN = 256


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a bucket: where it lies in the segment and what it is."""

    name: str
    dtype: str  # torch's name without the prefix: "float32", "bfloat16"
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class BucketMessage:
    """A bucket as the engine reads it: `slots` in a segment that is either the host file `path` of
    `size` bytes or the CUDA storage of `cuda_handle` (its `_share_cuda_()` tuple)."""

    slots: list[TensorSlot]
    size: int
    path: str | None = None
    cuda_handle: tuple | None = None


def bucket_layout(bucket: Mapping[str, Any]) -> tuple[list[TensorSlot], int]:
    """The slots of `bucket`'s tensors laid out one after the other (ALIGN each), and the bytes they take."""
    slots, offset = [], 0
    for name, tensor in bucket.items():
        slots.append(TensorSlot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += math.ceil(tensor.numel() * tensor.element_size() / ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


def _views(flat, slots: list[TensorSlot]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) over the uint8 tensor `flat` for each slot."""
    import torch

    for slot in slots:
        dtype = getattr(torch, slot.dtype)
        count = math.prod(slot.shape)
        nbytes = count * dtype.itemsize
        yield slot.name, flat[slot.offset : slot.offset + nbytes].view(dtype).view(slot.shape)


def _fill(flat, bucket: Mapping[str, Any], slots: list[TensorSlot]) -> None:
    for (_, view), tensor in zip(_views(flat, slots), bucket.values(), strict=True):
        view.copy_(tensor)


def shm_folder() -> Path:
    """Where host segments live: the shared-memory file system when the machine has one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass
class HostSegment:
    """The rank's side of host refits (module doc): reused bucket after bucket, grown when needed."""

    folder: Path = field(default_factory=shm_folder)
    _flat: Any = None
    _path: str | None = None
    _size: int = 0

    def put(self, bucket: Mapping[str, Any]) -> BucketMessage:
        """Copy `bucket` into the segment; the message that describes it."""
        slots, size = bucket_layout(bucket)
        if size > self._size:
            self._flat = None  # the smaller mapping goes before the larger is made
            self._path = str(self.folder / f"vlmrun-refit-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._flat, self._size = _map_file(self._path, size, create=True), size
        _fill(self._flat, bucket, slots)
        return BucketMessage(slots, self._size, path=self._path)

    def mapped(self) -> None:
        """The engine has mapped the segment: its file goes (the memory stays while either maps it)."""
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    def close(self) -> None:
        self.mapped()
        self._flat, self._path, self._size = None, None, 0


def _map_file(path: str, size: int, *, create: bool):
    import torch

    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


@dataclass
class CudaSegment:
    """The rank's side of GPU refits (module doc): one device buffer, reused, grown when needed."""

    device: Any = None
    _flat: Any = None

    def put(self, bucket: Mapping[str, Any]) -> BucketMessage:
        import torch

        slots, size = bucket_layout(bucket)
        if self._flat is None or self._flat.numel() < size:
            self._flat = None
            self._flat = classic_buffer(size, self.device)
        _fill(self._flat, bucket, slots)
        torch.cuda.synchronize(self._flat.device)  # written before the engine reads it
        return BucketMessage(slots, size, cuda_handle=tuple(self._flat.untyped_storage()._share_cuda_()))

    def mapped(self) -> None:
        """Nothing to do: the storage lives until `close`."""

    def close(self) -> None:
        self._flat = None


def classic_buffer(size: int, device: Any):
    """`size` bytes on `device` from a plain cudaMalloc block even under expandable segments (the
    project's PYTORCH_CUDA_ALLOC_CONF): their IPC handle is another format, read through pidfd_getfd
    (refused in unprivileged containers) and laid out differently across torch releases; the legacy
    handle of a plain block reads the same in both processes."""
    import torch

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:True" in conf.replace(" ", "")
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def segment_for(bucket: Mapping[str, Any]) -> HostSegment | CudaSegment:
    """The segment kind for `bucket`'s tensors: a GPU buffer for CUDA tensors, else host memory."""
    first = next(iter(bucket.values()), None)
    if first is not None and first.device.type == "cuda":
        return CudaSegment(device=first.device)
    return HostSegment()


class EngineSegments:
    """The engine's side: the mapping of the segment the last message named, kept until `close`."""

    def __init__(self) -> None:
        self._key: Any = None
        self._flat: Any = None

    def tensors(self, message: BucketMessage) -> Iterator[tuple[str, Any]]:
        """(name, tensor) views of the message's bucket, over the shared memory itself."""
        key = message.path or message.cuda_handle
        if key != self._key:
            self._flat = None
            self._flat = _open(message)
            self._key = key
        return _views(self._flat, message.slots)

    def close(self) -> None:
        self._key = self._flat = None


def _open(message: BucketMessage):
    import torch

    if message.path is not None:
        return _map_file(message.path, message.size, create=False)
    storage = torch.UntypedStorage._new_shared_cuda(*message.cuda_handle)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[: message.size]
