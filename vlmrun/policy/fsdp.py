"""FSDP2 for the hf backend: shard a transformers VLM over the data-parallel ranks, on any device.

Only torch is imported here (no Ray, no vlmrun config), so `tools/gpu/check.py` runs the same code on a
GPU machine that has nothing but torch and transformers.

1. One FSDP unit per decoder layer of the language model, then the root (embeddings, media towers and
   projectors, norm, head). The towers stay in the root, which every rank gathers at every forward: a
   unit of their own would be gathered only by ranks whose micro-batch has media (a collective
   mismatch). A text-only micro-batch leaves their parameters without gradient:
   `set_reduce_scatter_unused_params(True)` reduces zeros for them (gloo aborts with "collective
   mismatch" otherwise; NCCL would hang), and `touch_towers` gives them an exact zero gradient in the
   compute dtype, without which a bf16 mixed-precision root mixes bf16 gradients with fp32 zeros,
   which FSDP2's reduce-scatter refuses.
2. Gradients are SUMMED over ranks (the loss is already divided by the step's global token count):
   `set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)` on every unit (gloo
   has no PREMUL_SUM; neither setting recurses, so set only on the root, layer grads come out halved).
3. With gradient sync only on the last micro-batch (`set_requires_gradient_sync`), and the gradient
   norm taken over whole gradients as clip_grad_norm_ does (`grad_norm`), the parameters and norms
   are bitwise those of a replicated model with one flat all-reduce (dp=2, CPU).
4. `generate` runs the vision tower outside `forward`, where FSDP2 gathers nothing: GRPO's answers come
   from a generation engine refit from the shards; SFT's validation on GPUs generates with the sharded
   model itself, its root gathered for the call (generation/hf.py, 6).
5. On CPU every collective runs in the computing thread, one after the other, so FSDP2's overlap
   buffers overlap nothing and only hold memory: `serial_schedule` gathers a unit when it computes and
   frees each buffer when its collective has returned (a rank's host memory: docs/measurements.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vlmrun.config.layout import RankLayout


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How the model is sharded: `mixed_precision` "bf16" computes in bf16 over the model's own dtype
    (fp32 master weights when the model was loaded in fp32) and reduces gradients in fp32."""

    mixed_precision: str = "none"
    activation_checkpointing: bool = False
    cpu_offload: bool = False


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's decoder layers: the blocks of `_no_split_modules` under `language_model`.

    Raises ValueError when the model has none (a family whose layout this does not know yet).
    """
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and "language_model" in name.split("."):
            layers += [m for m in module if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found under language_model ({block_names})")
    return layers


#: Names of the towers and projectors beside the language model (Qwen2.5-VL `visual`; Nemotron-Omni
#: `vision_model`, `multi_modal_projector`, `sound_*`): each is an FSDP unit of its own.
_TOWER_WORDS = ("visual", "vision", "projector", "sound", "audio")


def media_towers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules (depth <= 2) that encode or project media, outside the language model."""
    towers = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if 0 < len(parts) <= 2 and "language_model" not in parts and any(w in parts[-1] for w in _TOWER_WORDS):
            if not any(module is not t and _contains(t, module) for t in towers):
                towers.append(module)
    return towers


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def touch_towers(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """`loss` plus 0 x the first element of every media tower parameter, called after the forward (the
    root's parameters are still gathered then) of a step's first micro-batch and of each whose backward
    reduce-scatters: each tower parameter gets a gradient there, zero where the micro-batch did not use it,
    and used ones get exactly their own gradient; so every gradient a reduce-scatter sees is in one dtype
    (accumulated ones in the reduce dtype from the first micro-batch on). One element each: the zero
    gradient is the parameter's whole either way, and reading every weight of the towers a micro-batch
    would cost what their forward reads."""
    touched = [p.view(-1)[0] for tower in media_towers(model) for p in tower.parameters() if p.requires_grad]
    if not touched:
        return loss
    return loss + 0.0 * torch.stack(touched).sum().to(loss.dtype)


def reshard_root(model: torch.nn.Module) -> None:
    """Give a sharded model's root unit back its shards after a forward that no backward follows
    (logprobs, the reference's, validation): FSDP2 keeps the root gathered from a forward to its
    backward (the decoder layers reshard after their forward themselves), so without this the root
    (embeddings, head, media towers) stays whole on every rank until the next training step. A model
    that is not sharded is left alone."""
    if hasattr(model, "reshard"):
        model.reshard()


def shard_mesh(device_type: str, layout: RankLayout):
    """The device mesh FSDP2 shards over: 1-D over every dp rank, or, under HSDP (`layout.dp_shard`), 2-D
    (replicate = `layout.replicas`, shard = `layout.shard_group`): rank r sits in shard group r // dp_shard,
    so consecutive ranks (ordered by node) hold one copy of the sharded state between them."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.replicas == 1:
        return init_device_mesh(device_type, (layout.dp,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (layout.replicas, layout.shard_group), mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, mesh, sharding: Sharding = Sharding()) -> torch.nn.Module:
    """Apply FSDP2 in place (see the module docstring) over `mesh` (`shard_mesh`: FSDP, or HSDP on a
    2-D mesh); returns `model`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # transformers returns its logits as a view; nothing here modifies them in place, which is what
    # FSDP2 warns about on every forward
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    kwargs = {"mesh": mesh}
    if sharding.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for tower in media_towers(model):  # some cast their pixels to their config's dtype (Nemotron-Omni)
            if getattr(tower, "config", None) is not None:
                tower.config.dtype = torch.bfloat16
    kwargs["offload_policy"] = CPUOffloadPolicy() if sharding.cpu_offload else OffloadPolicy()
    layers = decoder_layers(model)
    if sharding.activation_checkpointing:
        layers = checkpoint_layers(model, layers)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    units = fsdp_units(model)
    if not hasattr(units[0], "set_reduce_scatter_unused_params") and mesh.size() > 1:
        raise RuntimeError(
            f"FSDP2 over {mesh.size()} ranks needs FSDPModule.set_reduce_scatter_unused_params (torch >= 2.12; "
            f"this is torch {torch.__version__}): without it a text-only micro-batch on one rank breaks the "
            "gradient reduce-scatter; use parallel.fsdp: false or a newer torch"
        )
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        if hasattr(unit, "set_reduce_scatter_unused_params"):  # one rank: nothing to mismatch
            unit.set_reduce_scatter_unused_params(True)
    if mesh.device_type == "cpu":
        serial_schedule(units)
    return model


def serial_schedule(units: list) -> None:
    """FSDP2's schedule for a CPU mesh, where a collective returns when it is done (module doc, 5). Its
    defaults buy overlap on a GPU with memory; here a rank holds a unit's working set and no more:

    - forward: FSDP2 keeps a unit's all-gather buffer until the next unit's gather (the next gather
      overlaps this copy-out) unless the gather is asynchronous: `_set_unshard_async_op` (documented as
      settable) makes it so, and the buffer goes after its copy-out;
    - backward: FSDP2 gathers the next unit before this one computes; a unit told to prefetch itself
      prefetches nothing (FSDP2 has no other switch for its default), so a unit gathers when it computes;
    - the collectives themselves (`_GatherInPlace`, `_ReduceScatterInPlace`): gloo's all-gather and
      reduce-scatter stage a copy of their whole buffer (1-1.5x it, measured), where its broadcast and
      all-reduce work in place; the reduce-scatter's input is freed when it returns, where FSDP2 keeps it
      until the next unit's, for a stream that might still read it.

    Losses, gradients and weights are bitwise those of FSDP2's defaults (tests/test_host_memory.py).
    """
    for unit in units:
        unit._set_unshard_async_op(True)
        unit.set_modules_to_backward_prefetch([unit])
        unit.set_custom_all_gather(_GatherInPlace())
        unit.set_custom_reduce_scatter(_ReduceScatterInPlace())


def _slot(flat: torch.Tensor, index: int, world: int) -> torch.Tensor:
    size = flat.numel() // world
    return flat.narrow(0, index * size, size)


class _FreshBuffers:
    """A custom FSDP2 collective's buffers: plain tensors, freed when the last reference goes."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _GatherInPlace(_FreshBuffers):
    """FSDP2's all-gather (`FSDPModule.set_custom_all_gather`'s protocol): each rank broadcasts its slot
    of the output, where FSDP2 has already copied its shard. Called asynchronously (`serial_schedule`),
    it returns the last broadcast's work, which FSDP2 waits on before its copy-out."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        world, me = dist.get_world_size(group), dist.get_rank(group)
        mine = _slot(output_tensor, me, world)
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor)
        work = None
        for rank in range(world):
            last = rank == world - 1
            work = dist.broadcast(
                _slot(output_tensor, rank, world), group_src=rank, group=group, async_op=last and async_op
            )
        return work


class _ReduceScatterInPlace(_FreshBuffers):
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`'s protocol): the input reduced in
    place over the group, this rank's slot copied out, then the input freed."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(_slot(input_tensor, dist.get_rank(group), dist.get_world_size(group)))
        input_tensor.untyped_storage().resize_(0)
        return None


def fsdp_units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Reduce-scatter gradients after this backward (the step's last micro-batch) or accumulate locally."""
    model.set_requires_gradient_sync(enabled, recurse=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter or gradient; a plain tensor unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params: list[torch.nn.Parameter], *, sharded: bool) -> float:
    """The L2 norm of all gradients, identical on every rank.

    Replicas, and shards on a CPU mesh, take torch's clip_grad_norm_ arithmetic: fp32 norms per
    gradient (a shard's whole gradient is gathered one tensor at a time), then the norm of those. So a
    sharded run on CPU reports, and clips with, the bits of the replicated run (and of runs written
    before FSDP existed). On a GPU mesh gathering every gradient would cost a second all-gather of
    the model: each rank sums the squares of its shards in fp64 (each shard's fp64 norm, squared: no
    fp64 copy of a gradient, which on an offloaded rank's CPU would be twice its size again) and the sums
    are all-reduced over the shard group.
    """
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    mesh = getattr(grads[0], "device_mesh", None)
    if sharded and mesh is not None and mesh.device_type != "cpu":
        return norm_from_local_sums(grads, mesh)
    norms = [torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g, 2.0) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]), 2.0))


def norm_from_local_sums(grads: list[torch.Tensor], mesh) -> float:
    """The L2 norm of sharded gradients (DTensors on `mesh`) from each rank's fp64 sum of its shards'
    squares, all-reduced over the shard group (`grad_norm` on a GPU mesh): no gradient is gathered."""
    total = torch.zeros((), dtype=torch.float64, device=local_tensor(grads[0]).device)
    for g in grads:
        total += torch.linalg.vector_norm(local_tensor(g), 2, dtype=torch.float64).square()
    if mesh.size() > 1:  # over one shard group: HSDP's replicas hold the same shards
        group = mesh.get_group("shard") if mesh.ndim > 1 else mesh.get_group()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(torch.tensor(math.sqrt(float(total)), dtype=torch.float32))


def clip_gradients(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale gradients in place so their norm is at most `max_norm` (<= 0: no clipping), with the
    fp32 coefficient torch's clip_grad_norm_ computes (so the scaled bits match it), copied once to
    each device and dtype the gradients live in (not once per parameter)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    placed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for p in params:
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            key = (g.device, g.dtype)
            if key not in placed:
                placed[key] = coef.to(device=g.device, dtype=g.dtype)
            g.mul_(placed[key])


def checkpoint_layers(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Wrap each of `layers` in place in a non-reentrant activation checkpoint (its activations are
    recomputed in the backward); returns the wrappers. Parameter names do not change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    targets, wrapped = {id(m) for m in layers}, []
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, child in enumerate(module):
                if id(child) in targets:
                    module[i] = checkpoint_wrapper(child)
                    wrapped.append(module[i])
    return wrapped
