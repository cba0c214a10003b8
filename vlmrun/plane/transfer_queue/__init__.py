"""The `transfer_queue` adapter (TransferQueue with simple storage or Mooncake) and its servers.

Importing this package loads nothing heavy; `TransferQueuePlane` and the servers import TransferQueue
(and Ray) when they are built.
"""

from vlmrun.plane.transfer_queue.endpoint import (
    BACKENDS,
    Backend,
    MooncakeStoreConfig,
    ServerAddress,
    TransferQueueEndpoint,
)

__all__ = ["BACKENDS", "Backend", "MooncakeStoreConfig", "ServerAddress", "TransferQueueEndpoint"]
