"""Moving a policy's tensors to host memory while a rollout runs, and back (`parallel.offload_during_generation`).

GRPO's generation engine needs the GPU's memory while it samples (its weights, KV cache), the policy
needs it while it trains; neither uses the other's at the same time. `HostCopies.move` copies the
bytes of each tensor's storage into a host buffer (pinned on a GPU, so the copies run asynchronously)
and shrinks the storage to nothing, which hands its device memory back to the allocator; `restore`
grows each storage to its size again and copies the bytes back. Storages, not tensors: a parameter,
its FSDP2 shard (a view into a padded buffer) and anything else viewing the same memory come back
together and in place, so the modules, the optimizer's mapping and FSDP's own references stay valid
(FSDP2 frees and regrows its unsharded parameters the same way). On a CPU rank the host is the device:
the memory in use does not change, the same code runs (what the CPU tests check).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopies:
    """Storages moved to host memory (their device memory freed) until `restore` puts them back."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes held in host memory now."""
        return sum(host.numel() for _, host in self._held)

    @torch.no_grad()
    def move(self, tensors: Iterable[torch.Tensor], device: torch.device) -> int:
        """Move the storages of `tensors` that live on `device` (each once, whichever tensors view it;
        one already moved or empty is skipped, and one the allocator does not own, which cannot be
        freed: a CPU model's weights that `from_pretrained` maps from its files) to host memory;
        returns the bytes moved. A storage is
        freed on its device right after its copy is queued: the copy runs before anything the
        allocator gives that memory to next on the same stream."""
        seen = {s.data_ptr() for s, _ in self._held}
        storages = []
        for t in tensors:
            s = _local(t).untyped_storage()
            if s.device.type == device.type and s.nbytes() and s.resizable() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                storages.append(s)
        moved = 0
        for s in storages:
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
            host.copy_(_as_bytes(s), non_blocking=True)
            s.resize_(0)
            self._held.append((s, host))
            moved += host.numel()
        if device.type == "cuda":  # the host copies are complete before the engine takes the GPU
            torch.cuda.synchronize(device)
        return moved

    @torch.no_grad()
    def restore(self) -> int:
        """Every moved storage back on its device at its size, with its bytes; returns the bytes restored."""
        held, self._held = self._held, []
        restored = 0
        for s, host in held:
            s.resize_(host.numel())
            _as_bytes(s).copy_(host, non_blocking=True)
            restored += host.numel()
        if any(s.device.type == "cuda" for s, _ in held):  # the host buffers are dropped below
            torch.cuda.synchronize()
        return restored
