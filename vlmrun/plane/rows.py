"""The protocol of interface.py, once, over a `RowStore`: the few primitives each adapter implements.

`RowPlane` checks every call against the partition's spec and the field registry, turns values into
flat 1-D rows with the wire (wire/codec.py) and keeps, per sample, one tag dict: the writers' own
keys plus `_vlmrun` = {"fields": {field: wire tag}}. The wire tags say which fields a sample holds,
their dtypes and true shapes, so a store only moves rows: it never interprets shapes, and it may
leave rows of length 0 out of transit (Mooncake cannot store them) and rebuild them from the tag.

A store takes its requests in batches (`lookup`, `sample_tags`, `read`, `write` each take a list): a
store over the network overlaps their round trips, and `put_many` / `get_many` hand it a stage's
requests at once. What a store learns in a lookup it may keep in the `handle` it returns, for the
write or read of the same samples that follows in the same call (TransferQueue: their metadata).
"""

from __future__ import annotations

import abc
import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmrun.plane.fields import FIELDS, Alignment, field_spec
from vlmrun.plane.interface import Columns, DataPlane, DataPlaneError, Get, PartitionSpec, Put, SampleBatch
from vlmrun.plane.wire.codec import FieldTag, Pieces, decode_column, encode_column

#: The tag key the plane keeps for itself; writers' tags may use any other key. Sample ids may not
#: start with it followed by ":" (a store may keep its own records under such keys).
RESERVED_TAG = "_vlmrun"
#: field -> one 1-D row per sample (what a store reads back)
Rows = dict[str, list[torch.Tensor]]
#: field -> one row per sample as the wire's pieces (what a store writes; wire/codec.py)
RowPieces = dict[str, list[Pieces]]


@dataclass
class Tagged:
    """Each requested id's full tag dict (None for an id the partition lacks), and the store's handle."""

    tags: list[dict[str, Any] | None]
    handle: Any = None


@dataclass
class Lookup(Tagged):
    """What a put must know before it writes: `Tagged`, plus how many samples the partition holds and
    its spec as the store has it now (None: not registered)."""

    count: int = 0
    spec: dict[str, Any] | None = None


@dataclass
class Write:
    """Create the samples `ids` (`create`) or add columns to them; `tags` replace theirs whole;
    `rows[field][i]` is sample `ids[i]`'s row, as pieces."""

    partition: str
    ids: list[str]
    tags: list[dict[str, Any]]
    rows: RowPieces
    create: bool
    handle: Any = None  # from the lookup of the same ids


@dataclass
class Read:
    """`rows[field][i]` of sample `ids[i]`, whose tags are `tags[i]`."""

    partition: str
    ids: list[str]
    fields: list[str]
    tags: list[dict[str, Any]]
    handle: Any = None  # from the sample_tags of the same ids


class RowStore(abc.ABC):
    """Where an adapter keeps partitions: specs, per-sample tags and per-field rows."""

    @abc.abstractmethod
    def create_partition(self, partition: str, spec: dict[str, Any]) -> None:
        """Record `spec`; `DataPlaneError` when `partition` exists."""

    @abc.abstractmethod
    def partition_specs(self, partitions: list[str]) -> list[dict[str, Any] | None]:
        """Each partition's spec; None for one that is not registered."""

    @abc.abstractmethod
    def partition_names(self) -> list[str]: ...

    @abc.abstractmethod
    def sample_ids(self, partition: str) -> list[str]: ...

    @abc.abstractmethod
    def sample_tags(self, requests: list[tuple[str, list[str]]]) -> list[Tagged]:
        """Per (partition, ids): each id's tags."""

    @abc.abstractmethod
    def lookup(self, requests: list[tuple[str, list[str]]]) -> list[Lookup]:
        """Per (partition, ids): each id's tags, the partition's sample count and spec."""

    @abc.abstractmethod
    def write(self, writes: list[Write]) -> None:
        """Every write; no two write one sample."""

    @abc.abstractmethod
    def read(self, reads: list[Read]) -> list[Rows]: ...

    @abc.abstractmethod
    def drop(self, partition: str) -> None: ...

    def close(self) -> None:  # noqa: B027 - a store may hold nothing to release
        pass


class RowPlane(DataPlane):
    """A data plane over `store`; pixel values are cast to `pixel_dtype` before the wire (None: as given)."""

    def __init__(self, store: RowStore, *, pixel_dtype: torch.dtype | None = None):
        self.store = store
        self.pixel_dtype = pixel_dtype
        # A registered spec never changes, so it is asked for once per partition; a first write gets
        # it again from its lookup (the partition may have been cleared meanwhile by another client).
        self._specs: dict[str, PartitionSpec] = {}

    def register(self, partition: str, spec: PartitionSpec) -> None:
        if not isinstance(spec, PartitionSpec):
            raise DataPlaneError(f"register {partition!r} with a PartitionSpec, not {type(spec).__name__}")
        self.store.create_partition(_name(partition), spec.to_dict())
        self._specs[partition] = spec

    def spec(self, partition: str) -> PartitionSpec:
        return self._known_specs([partition])[0]

    def _known_specs(self, partitions: list[str]) -> list[PartitionSpec]:
        """The specs of `partitions`, asking the store at once for those not asked before."""
        names = [_name(p) for p in partitions]
        unknown = list(dict.fromkeys(n for n in names if n not in self._specs))
        for name, d in zip(unknown, self.store.partition_specs(unknown) if unknown else [], strict=True):
            if d is None:
                raise DataPlaneError(f"no partition {name!r} (registered: {self.partitions()})")
            self._specs[name] = PartitionSpec.from_dict(d)
        return [self._specs[n] for n in names]

    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Columns,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.put_many([Put(partition, sample_ids, columns, tags)])

    def put_many(self, requests: Sequence[Put]) -> None:
        """Every request is checked, and refused, before anything is written."""
        self._known_specs([r.partition for r in requests])
        checked = [self._checked_put(r) for r in requests]
        _distinct_samples([(r.partition, ids) for r, ids, _ in checked])
        lookups = self.store.lookup([(r.partition, ids) for r, ids, _ in checked])
        new: Counter[str] = Counter()  # samples each partition gains
        writes = []
        for (r, ids, user_tags), found in zip(checked, lookups, strict=True):
            create = _is_first_write(r.partition, ids, found.tags)
            if create:
                new[r.partition] += len(ids)
                self._check_capacity(r.partition, list(r.columns), found, new[r.partition])
            rows, field_tags = self._encode(r.partition, ids, r.columns)
            merged = _merge_tags(r.partition, ids, found.tags, field_tags, user_tags)
            writes.append(Write(r.partition, ids, merged, rows, create, found.handle))
        self.store.write(writes)

    def get(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> SampleBatch:
        return self.get_many([Get(partition, sample_ids, fields)])[0]

    def get_many(self, requests: Sequence[Get]) -> list[SampleBatch]:
        self._known_specs([r.partition for r in requests])
        checked = [self._checked_get(r) for r in requests]
        tagged = self.store.sample_tags([(r.partition, ids) for r, ids, _ in checked])
        reads = []
        for (r, ids, fields), found in zip(checked, tagged, strict=True):
            missing = [i for i, t in zip(ids, found.tags, strict=True) if t is None]
            if missing:
                raise DataPlaneError(f"{r.partition}: no sample(s) {missing[:5]} ({len(missing)} missing)")
            for name in fields:
                lacking = [i for i, t in zip(ids, found.tags, strict=True) if name not in t[RESERVED_TAG]["fields"]]
                if lacking:
                    raise DataPlaneError(f"{r.partition}: field {name!r} was not written for sample(s) {lacking[:5]}")
            reads.append(Read(r.partition, ids, fields, found.tags, found.handle))
        out = []
        for read, rows in zip(reads, self.store.read(reads), strict=True):
            wire = [t[RESERVED_TAG]["fields"] for t in read.tags]
            columns = {
                name: decode_column(field_spec(name), rows[name], [w[name] for w in wire]) for name in read.fields
            }
            out.append(SampleBatch(sample_ids=read.ids, columns=columns, tags=[_strip(t) for t in read.tags]))
        return out

    def list_sample_ids(self, partition: str) -> list[str]:
        self.spec(partition)
        return self.store.sample_ids(partition)

    def partitions(self) -> list[str]:
        return sorted(self.store.partition_names())

    def clear(self, partition: str) -> None:
        self._specs.pop(partition, None)
        self.store.drop(_name(partition))

    def state_dict(self) -> dict[str, Any]:
        """Per partition: its spec, ids and tags, and its rows grouped by the samples that hold the same fields."""
        state = {}
        for name in self.partitions():
            ids = self.store.sample_ids(name)
            tags = self.store.sample_tags([(name, ids)])[0].tags if ids else []
            groups: dict[tuple[str, ...], list[int]] = {}
            for i, t in enumerate(tags):
                groups.setdefault(tuple(sorted(t[RESERVED_TAG]["fields"])), []).append(i)
            reads = [
                Read(name, [ids[i] for i in idx], list(fields), [tags[i] for i in idx])
                for fields, idx in groups.items()
                if fields
            ]
            saved = [{"ids": r.ids, "rows": rows} for r, rows in zip(reads, self.store.read(reads), strict=True)]
            state[name] = {"spec": self.store.partition_specs([name])[0], "ids": ids, "tags": tags, "groups": saved}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in state.items():
            self.store.create_partition(name, part["spec"])
            if part["ids"]:
                self.store.write([Write(name, list(part["ids"]), list(part["tags"]), {}, create=True)])
            by_id = dict(zip(part["ids"], part["tags"], strict=True))
            writes = []
            for group in part["groups"]:
                ids = list(group["ids"])
                pieces = {f: [[r] for r in rows] for f, rows in group["rows"].items()}
                writes.append(Write(name, ids, [by_id[i] for i in ids], pieces, create=False))
            if writes:
                self.store.write(writes)

    def close(self) -> None:
        self.store.close()

    def _checked_put(self, r: Put) -> tuple[Put, list[str], list[dict[str, Any]]]:
        spec = self.spec(r.partition)
        ids = _ids(r.sample_ids)
        if not isinstance(r.columns, Mapping) or not r.columns:
            raise DataPlaneError(f"{r.partition}: put takes a non-empty mapping of field -> values per sample")
        _known_fields(r.partition, spec, list(r.columns))
        return r, ids, _user_tags(r.tags, len(ids))

    def _checked_get(self, r: Get) -> tuple[Get, list[str], list[str]]:
        spec = self.spec(r.partition)
        fields = r.fields
        if isinstance(fields, str) or not isinstance(fields, Sequence) or not fields:
            raise DataPlaneError(f"{r.partition}: get takes an explicit, non-empty list of field names, not {fields!r}")
        fields = list(fields)
        if len(set(fields)) != len(fields):
            raise DataPlaneError(f"{r.partition}: field list {fields} names a field twice")
        _known_fields(r.partition, spec, fields)
        return r, _ids(r.sample_ids), fields

    def _check_capacity(self, partition: str, fields: list[str], found: Lookup, new: int) -> None:
        """A first write: against the spec the store has now, which the partition's samples fit."""
        if found.spec is None:
            self._specs.pop(partition, None)
            raise DataPlaneError(f"no partition {partition!r} (registered: {self.partitions()})")
        spec = self._specs[partition] = PartitionSpec.from_dict(found.spec)
        _known_fields(partition, spec, fields)
        if found.count + new > spec.num_samples:
            raise DataPlaneError(f"{partition}: {new} more samples exceed its {spec.num_samples}")

    def _encode(self, partition: str, ids: list[str], columns: Columns) -> tuple[RowPieces, dict[str, list[FieldTag]]]:
        rows, tags = {}, {}
        for name, values in columns.items():
            if not isinstance(values, torch.Tensor) and isinstance(values, Sequence) and len(values) != len(ids):
                raise DataPlaneError(f"{partition}: field {name!r} has {len(values)} values for {len(ids)} samples")
            rows[name], tags[name] = encode_column(field_spec(name), values, pixel_dtype=self.pixel_dtype)
        return rows, tags


def _name(partition: str) -> str:
    if not isinstance(partition, str) or not partition:
        raise DataPlaneError(f"a partition name is a non-empty string, not {partition!r}")
    return partition


def _ids(sample_ids: Sequence[str]) -> list[str]:
    if isinstance(sample_ids, str) or not isinstance(sample_ids, Sequence) or not sample_ids:
        raise DataPlaneError(f"sample ids are a non-empty list of strings, not {sample_ids!r}")
    ids = list(sample_ids)
    if not all(isinstance(i, str) and i for i in ids):
        raise DataPlaneError(f"sample ids are non-empty strings: {ids[:5]}")
    if len(set(ids)) != len(ids):
        raise DataPlaneError(f"sample ids repeat: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    reserved = [i for i in ids if i.startswith(RESERVED_TAG + ":")]
    if reserved:
        raise DataPlaneError(f"sample ids may not start with {RESERVED_TAG + ':'!r}: {reserved[:5]}")
    return ids


def _distinct_samples(requests: list[tuple[str, list[str]]]) -> None:
    seen: set[tuple[str, str]] = set()
    for partition, ids in requests:
        again = [i for i in ids if (partition, i) in seen]
        if again:
            raise DataPlaneError(f"{partition}: one put_many writes each sample once, not {again[:5]} twice")
        seen.update((partition, i) for i in ids)


def _known_fields(partition: str, spec: PartitionSpec, fields: list[str]) -> None:
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise DataPlaneError(f"{partition}: unknown field(s) {unknown}; known: {', '.join(sorted(FIELDS))}")
    outside = [f for f in fields if f not in spec.fields]
    if outside:
        raise DataPlaneError(f"{partition}: field(s) {outside} are not in the partition (it has {list(spec.fields)})")


def _user_tags(tags: Sequence[Mapping[str, Any]] | None, n: int) -> list[dict[str, Any]]:
    if tags is None:
        return [{} for _ in range(n)]
    if isinstance(tags, Mapping) or len(tags) != n:
        raise DataPlaneError(f"tags are one dict per sample: expected {n}")
    out = []
    for t in tags:
        if not isinstance(t, Mapping) or not all(isinstance(k, str) for k in t) or RESERVED_TAG in t:
            raise DataPlaneError(f"a sample's tags are a dict with string keys other than {RESERVED_TAG!r}: {t!r}")
        out.append(dict(t))
    return out


def _is_first_write(partition: str, ids: list[str], old: list[dict[str, Any] | None]) -> bool:
    present = [t is not None for t in old]
    if all(present):
        return False
    if not any(present):
        return True
    known = [i for i, p in zip(ids, present, strict=True) if p]
    raise DataPlaneError(
        f"{partition}: one put writes new samples or adds columns to existing ones, not both (existing: {known[:5]})"
    )


def _merge_tags(
    partition: str,
    ids: list[str],
    old: list[dict[str, Any] | None],
    field_tags: dict[str, list[FieldTag]],
    user_tags: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    merged = []
    for i, sid in enumerate(ids):
        tag = copy.deepcopy(old[i]) if old[i] is not None else {RESERVED_TAG: {"fields": {}}}
        held = tag[RESERVED_TAG]["fields"]
        again = [name for name in field_tags if name in held]
        if again:
            raise DataPlaneError(f"{partition}: field(s) {again} of sample {sid!r} were already written (no overwrite)")
        for name, tags in field_tags.items():
            held[name] = tags[i]
        _check_token_alignment(partition, sid, held)
        tag.update(user_tags[i])
        merged.append(tag)
    return merged


def _check_token_alignment(partition: str, sid: str, held: dict[str, FieldTag]) -> None:
    for kind in (Alignment.PROMPT_TOKEN, Alignment.RESPONSE_TOKEN):
        lengths = {name: t["shape"][0] for name, t in held.items() if FIELDS[name].alignment is kind}
        if len(set(lengths.values())) > 1:
            raise DataPlaneError(f"{partition}: {kind} fields of sample {sid!r} differ in length: {lengths}")


def _strip(tag: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tag.items() if k != RESERVED_TAG}
