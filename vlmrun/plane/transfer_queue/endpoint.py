"""What a TransferQueue client needs to reach the job's servers: small, picklable records.

`start_transfer_queue` (servers.py) returns a `TransferQueueEndpoint`; the driver hands it to every
Ray actor that reads or writes the plane, and each builds its own `TransferQueuePlane` from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Backend = Literal["simple", "mooncake"]
BACKENDS: tuple[Backend, ...] = ("simple", "mooncake")
_MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class MooncakeStoreConfig:
    """How clients reach the job's `mooncake_master` (cluster/mooncake.py starts it) and what memory each
    lends the store.

    Every client mounts `segment_bytes` of its own memory into the distributed store and registers
    `buffer_bytes` for transfers: size them for the largest partition a step holds, divided over the
    clients. `local_hostname` is the address other clients reach this one at; "" takes the address
    this process's Ray node registered with (127.0.0.1 on a one-machine Ray, the node's address in a
    SLURM job).
    """

    master_address: str
    metadata_server: str
    local_hostname: str = ""
    protocol: Literal["tcp", "rdma"] = "tcp"
    segment_bytes: int = 512 * _MIB
    buffer_bytes: int = 128 * _MIB

    def client_config(self) -> dict[str, Any]:
        """The `backend.MooncakeStore` section of TransferQueue's config, auto_init off (it would kill
        every mooncake_master on the host)."""
        return {
            "auto_init": False,
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "local_hostname": self.local_hostname,
            "protocol": self.protocol,
            "global_segment_size": self.segment_bytes,
            "local_buffer_size": self.buffer_bytes,
            "device_name": "",
        }


@dataclass(frozen=True, kw_only=True)
class ServerAddress:
    """A TransferQueue server's ZMQ address, as plain data: unpickling it imports nothing (an actor
    that receives the endpoint must set TransferQueue's environment before TransferQueue is imported)."""

    role: str
    id: str
    ip: str
    ports: dict[str, int]

    @classmethod
    def of(cls, info: Any) -> ServerAddress:
        """From TransferQueue's `ZMQServerInfo`."""
        return cls(role=str(getattr(info.role, "value", info.role)), id=info.id, ip=info.ip, ports=dict(info.ports))

    def server_info(self) -> Any:
        """TransferQueue's `ZMQServerInfo` (imports TransferQueue)."""
        from transfer_queue.utils.enum_utils import Role
        from transfer_queue.utils.zmq_utils import ZMQServerInfo

        return ZMQServerInfo(role=Role(self.role), id=self.id, ip=self.ip, ports=dict(self.ports))


@dataclass(frozen=True, kw_only=True)
class TransferQueueEndpoint:
    """The controller's and the storage units' addresses and the backend."""

    backend: Backend
    controller: ServerAddress
    storage_units: dict[str, ServerAddress] = field(default_factory=dict)
    mooncake: MooncakeStoreConfig | None = None

    def storage_manager(self) -> tuple[str, dict[str, Any]]:
        """(manager type, config) for `TransferQueueClient.initialize_storage_manager` (imports TransferQueue)."""
        if self.backend == "simple":
            units = {name: a.server_info() for name, a in self.storage_units.items()}
            return "SimpleStorage", {"zmq_info": units, "num_data_storage_units": len(units)}
        if self.mooncake is None:
            raise ValueError("a mooncake endpoint needs its MooncakeStoreConfig")
        return "MooncakeStore", self.mooncake.client_config()
