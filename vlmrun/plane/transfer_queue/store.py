"""The `transfer_queue` adapter: partitions in TransferQueue (simple in-memory storage units or Mooncake).

1. Each process builds its own `TransferQueueClient` from the job's `TransferQueueEndpoint` (no
   TransferQueue globals, no `tq.init`, no Mooncake auto-init). Keys are our sample ids; a sample's
   tags are TransferQueue's per-key custom metadata; a partition's spec is the tag of the one key of a
   companion partition `<name>#spec`, so every process sees what the driver registered.
2. Each field crosses as one torch.nested jagged tensor of 1-D rows (wire/jagged.py). Rows of length 0
   stay home (Mooncake refuses empty values): their tags say what they are. Fields whose non-empty
   samples coincide travel in one put or get.
3. What comes back is normalized by `rows_of` (jagged, strided or dense, per backend) and checked
   against the tags before the wire decodes it, so callers get the shapes and dtypes they put.
4. Round trips to the controller are few: a get asks for its samples' metadata once
   (`kv_retrieve_meta`: tags and fields) and reads with it; a put lists the partition once (tags of
   its samples and their count). The metadata a `sample_tags` fetched is held for the `read` of the
   same samples that follows it, and dropped by any write.
5. TransferQueue sets torch's thread count around every put and get (to TQ_NUM_THREADS, then to the
   count it saw at import). The adapter pins TQ_NUM_THREADS to this process's count before the import
   and restores the caller's count after every call.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import torch

from vlmrun.plane.interface import DataPlaneError
from vlmrun.plane.rows import RESERVED_TAG, RowPieces, RowPlane, Rows, RowStore
from vlmrun.plane.transfer_queue.endpoint import TransferQueueEndpoint
from vlmrun.plane.wire.codec import empty_row, row_numel
from vlmrun.plane.wire.jagged import rows_of, to_jagged

_SPEC_SUFFIX = "#spec"
_SPEC_KEY = "spec"
_ZMQ_IO_THREADS = 2


def import_transfer_queue() -> None:
    """Import TransferQueue with its thread count pinned to this process's (module doc, 4)."""
    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(max(1, min(torch.get_num_threads(), cores))))
    import transfer_queue  # noqa: F401 - reads TQ_NUM_THREADS at import


@contextlib.contextmanager
def _caller_threads():
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class TransferQueueStore(RowStore):
    """Not thread-safe: one client per process (or per thread)."""

    def __init__(self, endpoint: TransferQueueEndpoint):
        import_transfer_queue()
        from transfer_queue.client import TransferQueueClient

        self.endpoint = endpoint
        client_id = f"vlmrun-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._client = TransferQueueClient(client_id, endpoint.controller.server_info(), zmq_io_threads=_ZMQ_IO_THREADS)
        self._held: tuple[str, tuple[str, ...], Any] | None = None  # (partition, ids, BatchMeta) (module doc, 4)
        manager, config = endpoint.storage_manager()
        if manager == "MooncakeStore" and not config["local_hostname"]:
            config["local_hostname"] = _ray_node_address()
        try:
            self._client.initialize_storage_manager(manager_type=manager, config=config)
        except BaseException:
            self._client.close()
            raise

    def create_partition(self, partition: str, spec: dict[str, Any]) -> None:
        if self.partition_spec(partition) is not None:
            raise DataPlaneError(f"partition {partition!r} is already registered (clear it first)")
        meta = self._client.kv_retrieve_meta(keys=[_SPEC_KEY], partition_id=partition + _SPEC_SUFFIX, create=True)
        meta.update_custom_meta([{_SPEC_KEY: dict(spec)}])
        self._client.set_custom_meta(meta)

    def partition_spec(self, partition: str) -> dict[str, Any] | None:
        listing = self._listing(partition + _SPEC_SUFFIX)
        return listing.get(_SPEC_KEY, {}).get(_SPEC_KEY)

    def partition_names(self) -> list[str]:
        names = self._client.kv_list(None)
        return [n.removesuffix(_SPEC_SUFFIX) for n, keys in names.items() if n.endswith(_SPEC_SUFFIX) and keys]

    def sample_ids(self, partition: str) -> list[str]:
        return [k for k, tag in self._listing(partition).items() if tag]

    def sample_tags(self, partition: str, ids: list[str]) -> list[dict[str, Any] | None]:
        self._held = None
        with _caller_threads():
            meta = self._client.kv_retrieve_meta(keys=ids, partition_id=partition, create=False)
        if meta.size == len(ids):  # in the order of `ids`
            self._held = (partition, tuple(ids), meta)
            return [dict(t) or None for t in meta.custom_meta]  # a key without our tag: a write that never finished
        listing = self._listing(partition)  # some are missing: say which
        return [listing.get(i) or None for i in ids]

    def tags_and_count(self, partition: str, ids: list[str]) -> tuple[list[dict[str, Any] | None], int]:
        listing = self._listing(partition)
        return [listing.get(i) or None for i in ids], sum(1 for tag in listing.values() if tag)

    def write(
        self, partition: str, ids: list[str], tags: list[dict[str, Any]], rows: RowPieces, *, create: bool
    ) -> None:
        self._held = None
        with _caller_threads():
            meta = self._client.kv_retrieve_meta(keys=ids, partition_id=partition, create=create)
            if meta.size != len(ids):
                raise DataPlaneError(f"{partition}: TransferQueue knows {meta.size} of {len(ids)} samples {ids[:5]}")
            meta.clear_custom_meta()
            meta.update_custom_meta(tags)
            self._client.set_custom_meta(meta)
            for fields, idx in _by_nonempty_samples(rows).items():
                data = _tensordict({f: to_jagged([rows[f][i] for i in idx]) for f in fields}, len(idx))
                self._client.put(data, meta if len(idx) == len(ids) else meta.select_samples(idx))

    def read(self, partition: str, ids: list[str], fields: list[str], tags: list[dict[str, Any]]) -> Rows:
        wire = [{f: t[RESERVED_TAG]["fields"][f] for f in fields} for t in tags]
        out: Rows = {f: [empty_row(w[f]) for w in wire] for f in fields}
        groups: dict[tuple[int, ...], list[str]] = {}  # samples with non-empty rows -> their fields
        for f in fields:
            idx = tuple(i for i, w in enumerate(wire) if row_numel(w[f]) > 0)
            if idx:
                groups.setdefault(idx, []).append(f)
        held, self._held = self._held, None
        whole = held[2] if held is not None and held[:2] == (partition, tuple(ids)) else None
        with _caller_threads():
            for idx, group in groups.items():
                sub = [ids[i] for i in idx]
                if whole is not None and len(idx) == len(ids) and set(group) <= set(whole.field_names):
                    meta = whole  # a field some samples lack is not in the whole batch's metadata: ask for theirs
                else:
                    meta = self._client.kv_retrieve_meta(keys=sub, partition_id=partition, create=False)
                lost = [f for f in group if f not in meta.field_names]
                if meta.size != len(sub) or lost:
                    raise DataPlaneError(f"{partition}: TransferQueue lost field(s) {lost or group} of {sub[:5]}")
                data = self._client.get_data(meta.select_fields(group))
                for f in group:
                    for i, row in zip(idx, rows_of(data[f], len(idx), f), strict=True):
                        out[f][i] = row
        return out

    def drop(self, partition: str) -> None:
        self._held = None
        with _caller_threads():
            samples = self._listing(partition)
            if samples:
                held = [
                    t for tag in samples.values() for t in (tag or {}).get(RESERVED_TAG, {}).get("fields", {}).values()
                ]
                self._clear(partition, stored=any(row_numel(t) > 0 for t in held))
            if self._listing(partition + _SPEC_SUFFIX):
                self._clear(partition + _SPEC_SUFFIX, stored=False)

    def _clear(self, name: str, *, stored: bool) -> None:
        if stored:
            self._client.clear_partition(name)
        else:
            # TransferQueue 0.1.11's KV storage managers (Mooncake) refuse to clear a partition that holds
            # no field, though storage holds nothing of it: forget it in the controller alone.
            self._client._run_coroutine(self._client._clear_partition_in_controller(name))

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

    def _listing(self, partition: str) -> dict[str, dict[str, Any]]:
        return self._client.kv_list(partition).get(partition, {})


class TransferQueuePlane(RowPlane):
    """The `transfer_queue` adapter (`backend: simple` or `backend: mooncake`, as the endpoint says).

    Pixel values are cast to `pixel_dtype` before the wire (None: as given). `close` ends this client's
    connections; the partitions live on in the job's servers.
    """

    def __init__(self, endpoint: TransferQueueEndpoint, *, pixel_dtype: torch.dtype | None = None):
        super().__init__(TransferQueueStore(endpoint), pixel_dtype=pixel_dtype)


def _ray_node_address() -> str:
    """The address this process's Ray node registered with (127.0.0.1 on a one-machine Ray), or "" outside
    Ray. Not TransferQueue's default, which can pick the machine's outward address on a loopback Ray."""
    import ray

    if not ray.is_initialized():
        return ""
    node_id = ray.get_runtime_context().get_node_id()
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "")


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
