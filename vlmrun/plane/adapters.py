"""Which adapter a process talks to: `open_plane` is the one call an algorithm makes to get its plane."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlmrun.plane.interface import DataPlane

if TYPE_CHECKING:
    import torch

    from vlmrun.plane.transfer_queue.endpoint import TransferQueueEndpoint


def open_plane(endpoint: TransferQueueEndpoint | None = None, *, pixel_dtype: torch.dtype | None = None) -> DataPlane:
    """The `local` plane (no endpoint: this process only) or a client of the job's TransferQueue
    (`backend` simple or mooncake, as the endpoint says). Pixel values are cast to `pixel_dtype`
    (the policy's dtype) before the wire; None keeps them as given."""
    if endpoint is None:
        from vlmrun.plane.local import LocalDataPlane

        return LocalDataPlane(pixel_dtype=pixel_dtype)
    from vlmrun.plane.transfer_queue.store import TransferQueuePlane

    return TransferQueuePlane(endpoint, pixel_dtype=pixel_dtype)
