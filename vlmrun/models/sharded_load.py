"""Sharded load: each rank reads from a model directory's safetensors files only the rows it holds.

A sharded policy (FSDP2 or HSDP) is built on the meta device from the directory's config and sharded
first; then `load_shards` allocates each rank's shards and fills them straight from the files: a
parameter sharded on dim 0 is a contiguous byte range of its tensor on disk, read with plain reads
(no mmap: mapped pages would count in the rank's memory) into the shard's own storage, through a
staging buffer of at most `chunk_bytes` when the file's dtype is not the model's. A rank's host
memory at load is its share plus that buffer, where `from_pretrained` on every rank held the whole
model per rank (8 x 132 GB for the 30B Omni on one node).

Names on disk are not the model's (transformers 5 renames at load: `model.layers.0...` on disk is
`model.language_model.layers.0...` in Qwen2.5-VL; Nemotron-Omni's experts are one file tensor each
and one fused parameter in the model; its vision tower's `qkv` is three parameters). `plan_load`
maps them with transformers' own conversion mapping and supports what keeps a shard a row range:
renames, `MergeModulelist(dim=0)` (expert i is row i of the fused tensor) and `Chunk(dim=0)` (target i
is the i-th block of rows). Anything else, or weights that are not safetensors, gives no plan: the
caller loads the whole model as before and says why. `get_model_conversion_mapping` and
`rename_source_key` are transformers' private API (5.24): tests/test_sharded_load.py names them, so an
upgrade that changes them fails there.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: safetensors' dtype names -> torch dtypes (the ones a VLM checkpoint holds)
DISK_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: the staging buffer's size when a file's dtype is not the model's (bytes of the file's dtype)
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class DiskTensor:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's data in `file`

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // max(rows, 1)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def safetensors_index(directory: str | Path) -> dict[str, DiskTensor] | None:
    """Every tensor of the directory's safetensors files by name, from their headers (an 8-byte
    little-endian length, then a JSON header); None when the weights are not safetensors."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        return None
    tensors: dict[str, DiskTensor] = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in DISK_DTYPES:
                return None
            begin, _ = entry["data_offsets"]
            tensors[name] = DiskTensor(path, DISK_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin)
    return tensors


def read_rows(src: DiskTensor, first: int, out: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Rows `first .. first + out.shape[0]` of `src` (dim 0; a 0-d tensor is its one value) into the
    contiguous CPU tensor `out`, converted to `out`'s dtype; at most `chunk_bytes` staged at a time
    when the dtypes differ (none when they agree: the bytes land in `out`)."""
    rows = out.shape[0] if out.dim() else 1
    if rows == 0:
        return
    row_bytes = src.row_bytes
    with open(src.file, "rb", buffering=0) as f:
        f.seek(src.start + first * row_bytes)
        if out.dtype == src.dtype:
            _read_exactly(f, out.reshape(-1).view(torch.uint8), src)
            return
        flat = out.reshape(rows, -1)
        step = max(1, chunk_bytes // max(row_bytes, 1))
        stage = torch.empty(min(step, rows) * row_bytes, dtype=torch.uint8)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            part = stage[: n * row_bytes]
            _read_exactly(f, part, src)
            flat[r : r + n].copy_(part.view(src.dtype).reshape(n, -1))


def _read_exactly(f, into: torch.Tensor, src: DiskTensor) -> None:
    """Fill the contiguous uint8 CPU tensor `into` from `f`. Through a view of its address, not
    `.numpy()`, which marks the storage not resizable for good (a policy's shard must stay movable:
    policy/host_offload.py)."""
    view = memoryview((ctypes.c_char * into.numel()).from_address(into.data_ptr())).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"{src.file}: ended {len(view) - got} bytes early inside a tensor (truncated file?)")
        got += n


@dataclass(frozen=True)
class Source:
    """Where a model tensor's rows are on disk: `keys` holds one name (rows `offset ..` of it: a
    rename, or block `offset / rows` of a `Chunk`), or one name per row of the fused tensor
    (`MergeModulelist`: row i is file tensor keys[i])."""

    keys: tuple[str, ...]
    offset: int = 0  # first row of this tensor in keys[0]
    chunks: int = 1  # keys[0] holds this many such tensors, one after the other on dim 0
    fused: bool = False


@dataclass
class LoadPlan:
    sources: dict[str, Source]  # model tensor name (parameters and persistent buffers) -> its source
    files: dict[str, DiskTensor] = field(repr=False)


def plan_load(model: torch.nn.Module, directory: str | Path) -> tuple[LoadPlan | None, str]:
    """Where every parameter and persistent buffer of `model` (built on the meta device from the
    directory's config, sharded or not) is in the directory's files; or (None, why) when the sharded
    load cannot read them (the caller loads the whole model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    files = safetensors_index(directory)
    if files is None:
        return None, f"{directory} holds no safetensors weights this reader knows"
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta = dict(model.state_dict(keep_vars=True))
    fused: dict[str, list[tuple[int, str]]] = {}
    sources: dict[str, Source] = {}
    for key in files:
        target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None), meta)
        if pattern is None:
            sources[target] = Source((key,))
            continue
        conv = next(c for c in converters if pattern in c.source_patterns)
        ops = [type(op).__name__ for op in conv.operations]
        dims = {getattr(op, "dim", 0) for op in conv.operations}
        if ops == ["MergeModulelist"] and dims == {0} and len(conv.source_patterns) == 1:
            index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
            if index is None:
                return None, f"cannot tell which expert {key} is ({pattern})"
            fused.setdefault(target, []).append((int(index.group(1)), key))
        elif ops == ["Chunk"] and dims == {0} and getattr(conv.operations[0], "num_shards_attribute", None) is None:
            first, parts = conv.target_patterns[0], conv.target_patterns
            if not all(re.fullmatch(r"[\w.]+", p) for p in parts) or first not in target:
                return None, f"cannot place the chunks of {key} ({parts})"
            rows = files[key].shape[0]
            if rows % len(parts):
                return None, f"{key}: {rows} rows do not split into {len(parts)} equal chunks"
            head, _, tail = target.rpartition(first)
            for i, part in enumerate(parts):
                sources[head + part + tail] = Source((key,), offset=i * rows // len(parts), chunks=len(parts))
        else:
            why = "only renames, MergeModulelist and Chunk on dim 0 read as row ranges"
            return None, f"{key} needs the conversion {'+'.join(ops)} at load ({why})"
    for target, experts in fused.items():
        experts.sort()
        if [i for i, _ in experts] != list(range(len(experts))):
            return None, f"{target}: experts {[i for i, _ in experts]} are not 0..{len(experts) - 1}"
        sources[target] = Source(tuple(k for _, k in experts), fused=True)
    missing = [name for name, names in _unique_tensors(model).items() if _source(names, sources) is None]
    if missing:
        return None, f"{len(missing)} tensor(s) of the model are not in its files, e.g. {missing[0]}"
    return LoadPlan(sources, files), ""


def _unique_tensors(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter (a tied one once, under its first name) and persistent buffer, with every name it
    goes by (a file holds a tied weight under any one of them)."""
    out: dict[str, list[str]] = {}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        if not is_adapter(names[0]):  # LoRA adapters are not in the files: the policy initialises them
            out[names[0]] = names
    persistent = model.state_dict(keep_vars=True)
    for name, _ in model.named_buffers():
        if name in persistent:
            out[name] = [name]
    return out


def _source(names: list[str], sources: dict[str, Source]) -> Source | None:
    return next((sources[n] for n in map(plan_name, names) if n in sources), None)


#: what activation checkpointing's wrapper adds to the names under it (torch's checkpoint_wrapper)
WRAPPED = "_checkpoint_wrapped_module."
#: peft's wrapping of a layer that has LoRA adapters (policy/lora.py): `x.base_layer.weight` is `x.weight`.
LORA_WRAPPED = ".base_layer."


def is_adapter(name: str) -> bool:
    """Whether a model tensor is a LoRA adapter's (policy/lora.py), which no model file holds."""
    return ".lora_A." in name or ".lora_B." in name


def plan_name(name: str) -> str:
    """The name of a model tensor as the plan knows it (built before any wrapping)."""
    return name.replace(WRAPPED, "").replace(LORA_WRAPPED, ".")


def load_shards(model: torch.nn.Module, plan: LoadPlan, *, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Fill every parameter and persistent buffer of `model` (materialized: `to_empty`) from the
    plan's files, each rank reading only its own rows; returns the bytes read from disk."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    read = 0
    for name, names in _unique_tensors(model).items():  # under no autograd: shards are written in place
        source = _source(names, plan.sources)
        if source is None:
            raise KeyError(f"{name}: not in the load plan")
        tensor = tensors[name]
        local, first = _local_rows(tensor)
        with torch.no_grad():
            read += _fill(local, first, tensor.shape, source, plan.files, chunk_bytes)
    return read


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of `tensor` (a DTensor sharded on dim 0 or replicated, or a plain tensor)
    and its first row in the whole tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor.detach(), 0
    if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in tensor.placements):
        raise ValueError(f"sharded load reads row ranges: placements {tensor.placements} are not Shard(0)/Replicate")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    with torch.no_grad():  # the shard's own storage, written in place
        local = tensor.to_local().detach()
    return local, (offset[0] if offset else 0)


def _fill(local: torch.Tensor, first: int, shape: torch.Size, source: Source, files, chunk_bytes: int) -> int:
    rows = local.shape[0] if local.dim() else 1
    if local.numel() == 0:
        return 0
    on_host = local.device.type == "cpu" and local.is_contiguous()
    target = local if on_host else torch.empty(local.shape, dtype=local.dtype)
    if source.fused:
        for i in range(rows):
            src = files[source.keys[first + i]]
            _check(src.shape, tuple(shape[1:]), source.keys[first + i])
            read_rows(src, 0, target[i].unsqueeze(0), chunk_bytes=chunk_bytes)
        nbytes = rows * files[source.keys[0]].nbytes
    else:
        src = files[source.keys[0]]
        whole = (shape[0] * source.chunks, *shape[1:]) if len(shape) else ()
        _check(src.shape, tuple(whole), source.keys[0])
        read_rows(src, source.offset + first, target, chunk_bytes=chunk_bytes)
        nbytes = rows * src.row_bytes
    if target is not local:
        local.copy_(target)  # a device shard (or a strided one): one shard's bytes staged, then copied
    return nbytes


def _check(disk: Iterable[int], model: tuple[int, ...], key: str) -> None:
    if tuple(disk) != model:
        raise ValueError(f"{key}: shape {tuple(disk)} on disk, {model} in the model")
