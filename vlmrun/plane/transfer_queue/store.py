"""The `transfer_queue` adapter: partitions in TransferQueue (simple in-memory storage units or Mooncake).

1. Each process builds its own `TransferQueueClient` from the job's `TransferQueueEndpoint` (no
   TransferQueue globals, no `tq.init`, no Mooncake auto-init). Keys are our sample ids; a sample's
   tags are TransferQueue's per-key custom metadata (our part of them as one JSON string: a nested
   dict costs TransferQueue's msgpack ~40x more per sample, on every listing, both ways); a
   partition's spec is the tag of its key
   `_vlmrun:spec` (sample ids may not start with `_vlmrun:`), so every process sees what the driver
   registered and one clear forgets both.
2. Each field crosses as one torch.nested jagged tensor of 1-D rows (wire/jagged.py). Rows of length 0
   stay home (Mooncake refuses empty values): their tags say what they are. Rows of at most
   `INLINE_BYTES` (a reward, an advantage, one image's grid size) ride in the sample's tag, base64
   under `inline`: no storage key, no storage round trip (a Mooncake put costs per key). Fields whose
   stored samples coincide travel in one put or get.
3. What comes back is normalized by `rows_of` (jagged, strided or dense, per backend) and checked
   against the tags before the wire decodes it, so callers get the shapes and dtypes they put.
4. Round trips are what a data plane over the network costs (each is milliseconds on a busy node), so
   they are few and overlapped. Every batch of requests (rows.py) runs as one coroutine on the client's
   event loop, its requests side by side. A get asks for its samples' metadata (tags, fields and
   storage indexes) once and reads with it. A put lists the partition (tags, sample count, spec) and,
   beside that, creates or fetches its samples' metadata; adding columns to samples this client read
   or wrote before, it writes with their metadata from then (a sample's storage index never changes;
   its tags come from the listing). A write sends the rows to storage and the tags to the controller
   side by side (TransferQueue's own `put` sends them one after the other).
5. TransferQueue sets torch's thread count around every put and get (to TQ_NUM_THREADS, then to the
   count it saw at import). The adapter pins TQ_NUM_THREADS to this process's count before the import
   and restores the caller's count after every call.
6. Every call is bounded: one that has no answer within `request_timeout_s` raises DataPlaneError.
   TransferQueue's own waits for a dead server are minutes (a put to a dead storage unit) or forever
   (the controller); the node's watchdog names a dead server within seconds (cluster/plane_servers.py),
   and this bound covers what it cannot see, a server alive but out of this client's reach.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import json
import os
import uuid
from typing import Any

import torch

from vlmrun.plane.interface import DataPlaneError
from vlmrun.plane.rows import RESERVED_TAG, Lookup, Read, RowPieces, RowPlane, Rows, RowStore, Tagged, Write
from vlmrun.plane.transfer_queue.endpoint import TransferQueueEndpoint
from vlmrun.plane.wire.codec import dtype_of, empty_row, row_numel
from vlmrun.plane.wire.jagged import rows_of, to_jagged

_SPEC_KEY = RESERVED_TAG + ":spec"
_ZMQ_IO_THREADS = 2
_METAS_HELD = 16
#: Rows of at most this many bytes travel in their sample's tag (module doc).
INLINE_BYTES = 32
#: The longest a plane call may wait for TransferQueue (module doc). A call moves one stage's share of a
#: step's partition, which takes seconds at the plane's speed; this allows minutes.
REQUEST_TIMEOUT_S = 120.0


def import_transfer_queue() -> None:
    """Import TransferQueue with its thread count pinned to this process's (module doc)."""
    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(max(1, min(torch.get_num_threads(), cores))))
    import transfer_queue  # noqa: F401 - reads TQ_NUM_THREADS at import


class TransferQueueStore(RowStore):
    """Not thread-safe: one client per process (or per thread). A call without an answer within
    `request_timeout_s` raises DataPlaneError (module doc)."""

    def __init__(self, endpoint: TransferQueueEndpoint, *, request_timeout_s: float = REQUEST_TIMEOUT_S):
        import_transfer_queue()
        from transfer_queue.client import TransferQueueClient

        self.endpoint, self.request_timeout_s = endpoint, request_timeout_s
        client_id = f"vlmrun-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._client = TransferQueueClient(client_id, endpoint.controller.server_info(), zmq_io_threads=_ZMQ_IO_THREADS)
        # (partition, ids) -> their BatchMeta from this client's last read or write of them (module doc)
        self._metas: collections.OrderedDict[tuple[str, tuple[str, ...]], Any] = collections.OrderedDict()
        manager, config = endpoint.storage_manager()
        if manager == "MooncakeStore" and not config["local_hostname"]:
            config["local_hostname"] = _ray_node_address()
        try:
            self._client.initialize_storage_manager(manager_type=manager, config=config)
        except BaseException:
            self._client.close()
            raise

    def create_partition(self, partition: str, spec: dict[str, Any]) -> None:
        async def create() -> None:
            meta = await self._client.async_kv_retrieve_meta(keys=[_SPEC_KEY], partition_id=partition, create=True)
            if meta.custom_meta[0]:
                raise DataPlaneError(f"partition {partition!r} is already registered (clear it first)")
            meta.update_custom_meta([{"spec": dict(spec)}])
            await self._client.async_set_custom_meta(meta)

        self._run(create())

    def partition_specs(self, partitions: list[str]) -> list[dict[str, Any] | None]:
        listings = self._run(_gather(self._client.async_kv_list(p) for p in partitions))
        return [_spec_of(listing.get(p, {})) for p, listing in zip(partitions, listings, strict=True)]

    def partition_names(self) -> list[str]:
        return [name for name, keys in self._run(self._client.async_kv_list(None)).items() if _spec_of(keys)]

    def sample_ids(self, partition: str) -> list[str]:
        keys = self._run(self._client.async_kv_list(partition)).get(partition, {})
        return [k for k, tag in keys.items() if tag and k != _SPEC_KEY]

    def sample_tags(self, requests: list[tuple[str, list[str]]]) -> list[Tagged]:
        async def one(partition: str, ids: list[str]) -> Tagged:
            meta = await self._retrieve(partition, ids, create=False)
            if meta.size == len(ids):  # in the order of `ids`; a key without our tag: a write that never finished
                self._remember(partition, ids, meta)
                return Tagged([_unpacked(t) for t in meta.custom_meta], handle=meta)
            keys = (await self._client.async_kv_list(partition)).get(partition, {})  # some are missing: say which
            return Tagged([_unpacked(keys.get(i)) for i in ids])

        return self._run(_gather(one(p, ids) for p, ids in requests))

    def lookup(self, requests: list[tuple[str, list[str]]]) -> list[Lookup]:
        partitions = list(dict.fromkeys(p for p, _ in requests))
        held = [self._metas.get((p, tuple(ids))) for p, ids in requests]

        async def both():
            # Beside the listing, the metadata of samples this client has none of: created if new. If the
            # put is then refused, a created key stays without tags (invisible, as a write that never finished).
            return await asyncio.gather(
                _gather(self._client.async_kv_list(p) for p in partitions),
                _gather(
                    self._retrieve(p, ids, create=True) for (p, ids), h in zip(requests, held, strict=True) if h is None
                ),
            )

        listings, created = self._run(both())
        keys_of = {p: listing.get(p, {}) for p, listing in zip(partitions, listings, strict=True)}
        self._forget_unregistered([p for p in partitions if _spec_of(keys_of[p]) is None])
        created = iter(created)
        out = []
        for (partition, ids), handle in zip(requests, held, strict=True):
            keys = keys_of[partition]
            count = sum(1 for k, tag in keys.items() if tag and k != _SPEC_KEY)
            tags = [_unpacked(keys.get(i)) for i in ids]
            if handle is None:
                handle = next(created)
            elif not all(tags):  # held from before, but the samples are gone (the partition was cleared)
                handle = None
            out.append(Lookup(tags, handle, count=count, spec=_spec_of(keys)))
        return out

    def _forget_unregistered(self, partitions: list[str]) -> None:
        """A put into a partition nobody registered (cleared by another client) is refused; what its lookup
        created is forgotten again."""
        for partition in partitions:
            self._run(self._client._clear_partition_in_controller(partition))

    def write(self, writes: list[Write]) -> None:
        self._run(_gather(self._write(w) for w in writes))

    def read(self, reads: list[Read]) -> list[Rows]:
        return self._run(_gather(self._read(r) for r in reads))

    def drop(self, partition: str) -> None:
        for key in [k for k in self._metas if k[0] == partition]:
            del self._metas[key]

        async def drop() -> None:
            keys = (await self._client.async_kv_list(partition)).get(partition, {})
            if not keys:
                return
            tags = [_unpacked(tag) for k, tag in keys.items() if k != _SPEC_KEY]
            if any(_stored(tag[RESERVED_TAG]) for tag in tags if tag):
                await self._client.async_clear_partition(partition)
            else:
                # TransferQueue 0.1.11's KV storage managers (Mooncake) refuse to clear a partition that
                # holds no field, though storage holds nothing of it: forget it in the controller alone.
                await self._client._clear_partition_in_controller(partition)

        self._run(drop())

    def close(self) -> None:
        """End this client's connections. Mooncake: unmounts the memory this client lent the store (call
        it while the master runs: a client left open retries a stopped master for ~20 s at exit)."""
        storage = getattr(self._client, "storage_manager", None)
        # TransferQueue 0.1.11 never closes its MooncakeDistributedStore; ours is at storage_client._store
        mooncake = getattr(getattr(storage, "storage_client", None), "_store", None)
        with contextlib.suppress(Exception):
            if storage is not None:
                storage.close()
        with contextlib.suppress(Exception):
            if mooncake is not None:
                mooncake.close()
        self._client.close()

    # ---- one request, as a coroutine on the client's loop ----------------------------------------
    async def _write(self, w: Write) -> None:
        meta = w.handle if w.handle is not None else await self._retrieve(w.partition, w.ids, create=w.create)
        if meta.size != len(w.ids):
            raise DataPlaneError(f"{w.partition}: TransferQueue knows {meta.size} of {len(w.ids)} samples {w.ids[:5]}")
        self._remember(w.partition, w.ids, meta)
        tags, rows = _inlined(w.tags, w.rows)
        meta.clear_custom_meta()
        meta.update_custom_meta([_packed(t) for t in tags])
        puts = []
        for fields, idx in _by_nonempty_samples(rows).items():
            data = _tensordict({f: to_jagged([rows[f][i] for i in idx]) for f in fields}, len(idx))
            # the storage put and its notice to the controller; the tags go beside it (module doc)
            puts.append(
                self._client.storage_manager.put_data(
                    data, meta if len(idx) == len(w.ids) else meta.select_samples(idx)
                )
            )
        await asyncio.gather(self._client.async_set_custom_meta(meta), *puts)

    async def _read(self, r: Read) -> Rows:
        wire = [{f: t[RESERVED_TAG]["fields"][f] for f in r.fields} for t in r.tags]
        inline = [t[RESERVED_TAG].get("inline", {}) for t in r.tags]
        out: Rows = {
            f: [_row_of(inline[i][f], w[f]) if f in inline[i] else empty_row(w[f]) for i, w in enumerate(wire)]
            for f in r.fields
        }
        groups: dict[tuple[int, ...], list[str]] = {}  # samples with stored rows -> their fields
        for f in r.fields:
            idx = tuple(i for i, w in enumerate(wire) if row_numel(w[f]) > 0 and f not in inline[i])
            if idx:
                groups.setdefault(idx, []).append(f)

        async def group(idx: tuple[int, ...], fields: list[str]) -> None:
            sub = [r.ids[i] for i in idx]
            whole = r.handle
            if whole is not None and len(idx) == len(r.ids) and set(fields) <= set(whole.field_names):
                meta = whole  # a field some samples lack is not in the whole batch's metadata: ask for theirs
            else:
                meta = await self._retrieve(r.partition, sub, create=False)
            lost = [f for f in fields if f not in meta.field_names]
            if meta.size != len(sub) or lost:
                raise DataPlaneError(f"{r.partition}: TransferQueue lost field(s) {lost or fields} of {sub[:5]}")
            data = await self._client.async_get_data(meta.select_fields(fields))
            for f in fields:
                for i, row in zip(idx, rows_of(data[f], len(idx), f), strict=True):
                    out[f][i] = row

        await _gather(group(idx, fields) for idx, fields in groups.items())
        return out

    def _remember(self, partition: str, ids: list[str], meta) -> None:
        self._metas[(partition, tuple(ids))] = meta
        self._metas.move_to_end((partition, tuple(ids)))
        while len(self._metas) > _METAS_HELD:
            self._metas.popitem(last=False)

    async def _retrieve(self, partition: str, ids: list[str], *, create: bool):
        return await self._client.async_kv_retrieve_meta(keys=ids, partition_id=partition, create=create)

    def _run(self, coroutine):
        """Run `coroutine` on the client's event loop, for at most `request_timeout_s`; torch's thread
        count is the caller's again after."""
        threads = torch.get_num_threads()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._client._loop)
        try:
            concurrent.futures.wait([future], timeout=self.request_timeout_s)
            if not future.done():
                future.cancel()
                c = self.endpoint.controller
                raise DataPlaneError(
                    f"TransferQueue did not answer within {self.request_timeout_s:.0f} s (its controller at "
                    f"{c.ip}): a server of the job's data plane is gone or out of reach"
                )
            return future.result()
        finally:
            torch.set_num_threads(threads)


class TransferQueuePlane(RowPlane):
    """The `transfer_queue` adapter (`backend: simple` or `backend: mooncake`, as the endpoint says).

    Pixel values are cast to `pixel_dtype` before the wire (None: as given). `close` ends this client's
    connections; the partitions live on in the job's servers. A call waits at most `request_timeout_s`.
    """

    def __init__(
        self,
        endpoint: TransferQueueEndpoint,
        *,
        pixel_dtype: torch.dtype | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        super().__init__(TransferQueueStore(endpoint, request_timeout_s=request_timeout_s), pixel_dtype=pixel_dtype)


def _ray_node_address() -> str:
    """The address this process's Ray node registered with (127.0.0.1 on a one-machine Ray), or "" outside
    Ray. Not TransferQueue's default, which can pick the machine's outward address on a loopback Ray."""
    import ray

    if not ray.is_initialized():
        return ""
    node_id = ray.get_runtime_context().get_node_id()
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "")


async def _gather(coroutines) -> list:
    return list(await asyncio.gather(*coroutines))


def _packed(tag: dict[str, Any]) -> dict[str, Any]:
    """A tag as TransferQueue keeps it: our part as one JSON string (module doc)."""
    return {**tag, RESERVED_TAG: json.dumps(tag[RESERVED_TAG], separators=(",", ":"))}


def _unpacked(tag: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tag as TransferQueue returns it (`_packed`); None for a key without one."""
    if not tag:
        return None
    ours = tag.get(RESERVED_TAG)
    return {**tag, RESERVED_TAG: json.loads(ours)} if isinstance(ours, str) else dict(tag)


def _spec_of(keys: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The spec in a partition's listing (module doc); None: not registered."""
    return (keys.get(_SPEC_KEY) or {}).get("spec")


def _inlined(tags: list[dict[str, Any]], rows: RowPieces) -> tuple[list[dict[str, Any]], RowPieces]:
    """`tags` with the rows of at most INLINE_BYTES in them, and `rows` without those (module doc)."""
    tags = [{**t, RESERVED_TAG: {**t[RESERVED_TAG], "inline": dict(t[RESERVED_TAG].get("inline", {}))}} for t in tags]
    kept: RowPieces = {}
    for name, column in rows.items():
        kept[name] = []
        for tag, pieces in zip(tags, column, strict=True):
            nbytes = sum(p.numel() * p.element_size() for p in pieces)
            if 0 < nbytes <= INLINE_BYTES:
                flat = torch.cat([p.reshape(-1) for p in pieces]).contiguous()
                tag[RESERVED_TAG]["inline"][name] = base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()
                kept[name].append([])
            else:
                kept[name].append(pieces)
    return tags, kept


def _row_of(inline: str, wire: dict[str, Any]) -> torch.Tensor:
    """The 1-D row a tag carries (`_inlined`), in its wire dtype."""
    return torch.frombuffer(bytearray(base64.b64decode(inline)), dtype=torch.uint8).view(dtype_of(wire["dtype"]))


def _stored(ours: dict[str, Any]) -> bool:
    """Whether a sample (our part of its tag) has a row in storage: non-empty and not inline."""
    inline = ours.get("inline", {})
    return any(row_numel(t) > 0 and f not in inline for f, t in ours["fields"].items())


def _by_nonempty_samples(rows: RowPieces) -> dict[tuple[str, ...], list[int]]:
    """Fields grouped by the samples whose rows are not empty: one put per group."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, column in rows.items():
        idx = tuple(i for i, pieces in enumerate(column) if sum(p.numel() for p in pieces) > 0)
        if idx:
            groups.setdefault(idx, []).append(name)
    return {tuple(fields): list(idx) for idx, fields in groups.items()}


def _tensordict(columns: dict[str, torch.Tensor], n: int):
    from tensordict import TensorDict

    return TensorDict(columns, batch_size=[n])
