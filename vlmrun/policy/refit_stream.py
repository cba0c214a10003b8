"""The policy's weights as a refit takes them: whole tensors in the engine's dtype, bucket by bucket.

1. `refit_buckets` yields {name: whole tensor} buckets of at most `bucket_bytes` (a tensor larger than
   that alone), the next tensor gathered only once the bucket before it is handed on: a refit holds one
   bucket of whole tensors, never the model.
2. A sharded tensor (a DTensor of FSDP2 or HSDP, its rows split over one mesh dimension) is cast on its
   shard and gathered straight into the whole tensor it becomes (`gather_rows`), a slice of rows at a
   time: beyond that tensor, the gather holds about 2.5 slices of a sixteenth of a bucket each (what one
   all-gather brings, the process group's own copy of it over gloo, this rank's cast slice), where
   `DTensor.full_tensor()` held the cast shard, every rank's shard and their concatenation at once
   (over gloo). Any other layout goes through `full_tensor()`. The slices' two buffers are allocated
   once a refit (`Scratch`) and reused: no allocation (on the host: no fresh pages) per slice, and
   they are freed by the refit's own thread, where a fresh buffer per slice was freed by the process
   group's worker thread once the collective let it go (which torch.profiler does not see: its
   count of the bytes allocated then only grows, tools/measure_memory.py).
3. `into` (name -> the engine's own tensor, `GenerationBackend.refit_targets`): a tensor whose target
   has its shape and dtype is cast or gathered straight into it, and the bucket carries the target
   itself (the engine's copy is then none): such a refit holds no whole tensor beyond the engine's,
   only the slices.
4. Collective: every rank of the mesh draws the same tensors in the same order. The values are the
   shards' own, cast elementwise: the same bits whichever way they are gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

#: torch 2.14 names the gather into one tensor `all_gather_single` (the older name warns at every call)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: A sharded tensor is gathered in slices of at most bucket_bytes / SLICES_PER_BUCKET (module doc): with
#: the gather's copies and the pages the host allocator keeps, its resident peak is under one bucket.
SLICES_PER_BUCKET = 16


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s state dict, a tied weight once (under its first name: one gather, not one per name)."""
    from vlmrun.models.sharded_load import WRAPPED

    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        # state_dict names drop activation checkpointing's wrapper, which parameter names keep
        tied.setdefault(id(p), []).append(name.replace(WRAPPED, ""))
    later = {n for names in tied.values() for n in names[1:]}
    for name, t in model.state_dict().items():
        if name not in later:
            yield name, t


def refit_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    want: torch.dtype | None,
    bucket_bytes: int,
    into: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Buckets of whole tensors (module doc), floating ones in `want` (None: as they are), written
    into the tensors of `into` where they fit (module doc)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    scratch = Scratch()
    for name, t in tensors:
        t = t.detach()
        dtype = want if want is not None and t.is_floating_point() else t.dtype
        target = (into or {}).get(name)
        if target is not None and (target.shape != t.shape or target.dtype != dtype):
            target = None
        nbytes = 0 if target is not None else t.numel() * dtype.itemsize  # written in place: nothing held
        if bucket and size + nbytes > bucket_bytes:  # before this one is gathered: one bucket alive at a time
            yield bucket
            bucket, size = {}, 0
        bucket[name] = whole(t, dtype, max(1, bucket_bytes // SLICES_PER_BUCKET), out=target, scratch=scratch)
        size += nbytes
        del t
    if bucket:
        yield bucket


class Scratch:
    """The working buffers of a refit's gathers, reused slice after slice and tensor after tensor (module
    doc): one per role and device, bytes, grown when a slice needs more."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, torch.device], torch.Tensor] = {}

    def take(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A `shape` tensor of `dtype` on `device` over the `role` buffer (its values are left over)."""
        nbytes = math.prod(shape) * dtype.itemsize
        flat = self._bytes.get((role, device))
        if flat is None or flat.numel() < nbytes:
            self._bytes.pop((role, device), None)  # let the smaller one go before the larger is allocated
            flat = self._bytes[role, device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return flat[:nbytes].view(dtype).view(shape)


def whole(
    t: torch.Tensor,
    dtype: torch.dtype,
    slice_bytes: int,
    out: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """`t` whole and in `dtype`: a plain tensor cast (itself when it is in `dtype`), a sharded one
    gathered on its mesh's device, at most `slice_bytes` an all-gather, through `scratch`'s buffers (a
    refit passes its own; default: this call's) (module doc); with `out`, written into it (module
    doc), which is returned."""
    if not hasattr(t, "full_tensor"):
        if out is not None:
            return out.copy_(t)
        return t if t.dtype == dtype else t.to(dtype)
    dim = _row_dim(t)
    if dim is not None:
        gathered = gather_rows(t, dtype, dim, slice_bytes, out=out, scratch=scratch)
        if gathered is not None:
            return gathered
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.device.type != t.device_mesh.device_type:  # offloaded shards: gathered on the mesh's device
        t = t.to(t.device_mesh.device_type)
    full = t.full_tensor()
    return full if out is None else out.copy_(full)


def _row_dim(t) -> int | None:
    """The mesh dimension `t`'s rows are split over, when that is its only split (the others replicate)."""
    from torch.distributed.tensor import Replicate, Shard

    if t.ndim == 0:
        return None
    split = [d for d, p in enumerate(t.placements) if isinstance(p, Shard) and p.dim == 0]
    rest = [p for d, p in enumerate(t.placements) if d not in split]
    return split[0] if len(split) == 1 and all(isinstance(p, Replicate) for p in rest) else None


def gather_rows(
    t,
    dtype: torch.dtype,
    mesh_dim: int,
    slice_bytes: int,
    out: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor | None:
    """The whole of `t` (rows split over `mesh_dim` in torch.chunk's way: ceil(rows / n) a rank, the last
    ranks fewer or none), cast slice by slice and gathered into one tensor, each all-gather bringing at
    most `slice_bytes` (one row at least), into `out` when given (on another device than the mesh's:
    gathered there, then copied slice by slice); None when this rank's shard is not the rows that split
    gives it (then the caller takes `full_tensor()`). The slices go through `scratch`'s buffers."""
    mesh = t.device_mesh
    group, n, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    rows = t.shape[0]
    per = -(-rows // n)
    local = t.to_local()
    if local.shape[0] != max(0, min(per, rows - me * per)) or local.shape[1:] != t.shape[1:]:
        return None
    device = torch.device(mesh.device_type) if local.device.type != mesh.device_type else local.device
    if out is None:
        out = torch.empty(t.shape, dtype=dtype, device=device)
    scratch = scratch if scratch is not None else Scratch()
    row_bytes = max(1, math.prod(t.shape[1:]) * dtype.itemsize)
    step = max(1, slice_bytes // (n * row_bytes))
    for start in range(0, per, step):
        count = min(step, per - start)
        piece = scratch.take("piece", (count, *t.shape[1:]), dtype, device)
        mine = local[start : start + count]
        piece[: mine.shape[0]] = mine  # cast (and moved) on the way; rows past the shard's end are padding
        brought = scratch.take("brought", (n * count, *t.shape[1:]), dtype, device)
        _all_gather_single(brought, piece, group=group)
        for r in range(n):
            first = r * per + start
            take = max(0, min(count, rows - first))  # a rank's padding rows are never copied out
            if take:
                out[first : first + take] = brought[r * count : r * count + take]
    return out
