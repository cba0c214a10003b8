"""The `hf` policy backend: a transformers model on every data-parallel rank, on CPU (gloo) or GPU (NCCL).

Two layouts (`parallel.fsdp`), one set of numbers:

1. Replicated: each rank holds the whole model, optimizer and LR schedule; gradients are summed across
   ranks in one flat all-reduce (grad_sync.py), so every replica takes the same step and holds the
   same state (rank 0 alone saves it).
2. Sharded (FSDP2, fsdp.py): each rank holds 1/dp of parameters, gradients and optimizer state;
   gradients are reduce-scattered once per step (the last micro-batch) as a sum; every rank saves its
   own shard (`Storage.SHARDED`). On CPU with dp=2 both layouts give bitwise-equal losses, gradient
   norms and parameters (tests/test_fsdp_policy.py).

The model comes from a `ModelSpec` (models/spec.py, built by models/build.py): a directory, or a
config for random init (built on the meta device and materialized shard by shard when sharded), so
checks and benchmarks train large random-init models through this same class. The device is the rank's GPU when the
recipe's cluster has GPUs (Ray sets CUDA_VISIBLE_DEVICES to the rank's bundle, so it is `cuda:0`),
else the CPU. Micro-batches arrive on the CPU and are moved here.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, POLICY_PARTS, PolicyState, Storage
from vlmrun.config.dtype import torch_dtype
from vlmrun.config.layout import RankLayout
from vlmrun.models import sharded_load
from vlmrun.models.build import build_model, materialize, materialize_buffers
from vlmrun.models.packing import packed_inputs
from vlmrun.models.shared_images import vision_once
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import hf_export, rng
from vlmrun.policy.device import join_process_group, prepare_cuda_allocator, rank_device, to_device
from vlmrun.policy.fsdp import (
    Sharding,
    checkpoint_layers,
    clip_gradients,
    decoder_layers,
    grad_norm,
    reshard_root,
    set_gradient_sync,
    shard_mesh,
    shard_model,
    touch_towers,
)
from vlmrun.policy.grad_sync import all_reduce_gradients, all_reduce_sum
from vlmrun.policy.host_memory import StepPeak, trim
from vlmrun.policy.host_offload import HostCopies
from vlmrun.policy.interface import REFIT_BUCKET_BYTES, PolicyBackend, StepResult, TokenLoss
from vlmrun.policy.kernels import check_cuda_kernels
from vlmrun.policy.lora import (
    adapter_state,
    adapters_off,
    add_adapters,
    init_adapters,
    load_adapters,
    merged_tensors,
    no_adapter_dropout,
)
from vlmrun.policy.loss import LossStats, NllLoss, kept_logits, labelled_logprobs, logits_to_keep, scored_positions
from vlmrun.policy.optimizer import allocate_state, build_optimizer
from vlmrun.policy.refit_stream import SLICES_PER_BUCKET, refit_buckets, state_tensors, whole


class HfPolicy(PolicyBackend):
    """Rank `rank` of `world_size` of the model `model`; `train` is the recipe's train section,
    `parallel` its parallel section (None: replicated, no options), `gpus` whether ranks own a GPU.
    Built by `vlmrun.policy.open_policy`."""

    def __init__(self, *, model: ModelSpec, rank: int, world_size: int, train, parallel=None, gpus: bool = False):
        self.rank, self.world_size = rank, world_size
        self.spec, self.train = model, train
        self.sharded = bool(parallel is not None and parallel.fsdp)
        self.sharding = Sharding(
            mixed_precision=getattr(parallel, "mixed_precision", "none"),
            activation_checkpointing=getattr(parallel, "activation_checkpointing", False),
            cpu_offload=getattr(parallel, "cpu_offload", False),
        )
        self.sync_every = bool(getattr(parallel, "reduce_every_micro_batch", False))
        # the hf backend's ranks are data-parallel only; HSDP: shard groups of dp_shard ranks
        self.ranks = RankLayout(dp=world_size, dp_shard=getattr(parallel, "dp_shard", None))
        self.gpus = gpus
        self._peak = StepPeak()
        if gpus:  # before anything in this rank's process touches CUDA (its generation engine too)
            prepare_cuda_allocator()

    def setup(self, *, master_addr: str, master_port: int, max_steps: int, weights: str = "load") -> dict[str, Any]:
        if weights not in ("load", "checkpoint"):
            raise ValueError(f"weights {weights!r}: 'load' or 'checkpoint'")
        self.device = rank_device(self.gpus)
        if self.world_size > 1 or self.sharded:
            join_process_group(
                self.device,
                master_addr=master_addr,
                master_port=master_port,
                rank=self.rank,
                world_size=self.world_size,
            )
        self.max_steps = max_steps
        self._build(unread=weights == "checkpoint")
        return {
            "rank": self.rank,
            "params": sum(p.numel() for p in self.params),
            "device": str(self.device),
            "layout": self.layout(),
            "load": self.weights_load,
        }

    def _build(self, *, unread: bool) -> None:
        rng.seed_all(self.train.seed + self.rank)
        # LoRA: a checkpoint holds the adapters only, so the base is read from the model's files either way
        self.model = self._build_unread() if unread and self.spec.lora is None else self._build_model()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, self.train, self.max_steps, fused=self.gpus)

    def load_model_weights(self) -> None:
        self.model = self.params = self.optimizer = self.scheduler = None  # the unread build goes first
        self._build(unread=False)

    def layout(self) -> str:
        """How the ranks hold the model, in words (the run's log says it once)."""
        if not self.sharded:
            return f"replicated on {self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if self.ranks.replicas > 1:
            return f"HSDP: {self.ranks.replicas} replicas x {self.ranks.shard_group} shards (FSDP2)"
        return f"FSDP2 over {self.world_size} rank{'s' if self.world_size > 1 else ''}"

    def _build_model(self, *, trainable: bool = True) -> torch.nn.Module:
        """The spec's model on this rank's device, sharded when `parallel.fsdp`: built on the meta
        device then, and each rank materializes only its shards (random init, or its rows read from
        the directory's files: models/sharded_load.py; a directory that reader cannot map is loaded
        whole on every rank, as unsharded, and the log says why)."""
        on_meta, plan = self.sharded, None
        model = build_model(self.spec, device=self.device, on_meta=on_meta)
        if self.spec.random_init:
            load = f"random init (seed {self.spec.seed})" + (", each rank its own shards" if on_meta else "")
        elif on_meta:
            plan, why = sharded_load.plan_load(model, self.spec.directory)
            load = "each rank read only its own rows of the weights' files"
            if plan is None:  # the reader cannot map these files: load it whole, as unsharded
                model, on_meta, load = build_model(self.spec, device=self.device), False, f"whole on every rank: {why}"
        else:
            load = "whole on every rank (replicated)"
        if trainable:
            self.weights_load = load  # job.json's attempt says it (policy_load)
        check_cuda_kernels(model, self.device)
        if not trainable:
            model.requires_grad_(False)
        lora = self.spec.lora if trainable else None
        if lora is not None:  # before sharding: the adapters shard with their layers (policy/lora.py)
            add_adapters(model, lora)
        if self.sharded:
            mesh = shard_mesh(self.device.type, self.ranks)
            frozen = Sharding(mixed_precision=self.sharding.mixed_precision, cpu_offload=self.sharding.cpu_offload)
            model = shard_model(model, mesh, self.sharding if trainable else frozen)
            if on_meta:  # offloaded shards live in host memory
                home = torch.device("cpu") if self.sharding.cpu_offload else self.device
                materialize(model, self.spec, home, plan)
            if lora is not None:
                init_adapters(model, lora, self.train.seed)
            return model
        if lora is not None:
            init_adapters(model, lora, self.train.seed)
        if self.sharding.activation_checkpointing and trainable:
            checkpoint_layers(model, decoder_layers(model))
        return model.to(self.device)

    def _build_unread(self) -> torch.nn.Module:
        """The policy's model for a resume: built on the meta device, sharded like `_build_model`'s, its
        tensors allocated on this rank's device and only the buffers no checkpoint holds computed
        (rotary frequencies); every parameter and persistent buffer comes from the checkpoint loaded
        next, so nothing of the model's own files is read (a strict load refuses a checkpoint that
        lacks one)."""
        model = build_model(self.spec, device=self.device, on_meta=True)
        self.weights_load = "from the checkpoint it resumed (the model's own weights not read)"
        if self.sharded:
            mesh = shard_mesh(self.device.type, self.ranks)
            model = shard_model(model, mesh, self.sharding)
            return materialize_buffers(model, torch.device("cpu") if self.sharding.cpu_offload else self.device)
        if self.sharding.activation_checkpointing:
            checkpoint_layers(model, decoder_layers(model))
        return materialize_buffers(model, self.device)

    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        t0 = time.perf_counter()
        self._peak.reset()
        loss = loss or NllLoss()
        local_tokens = sum(loss.tokens(b) for b in micro_batches)
        (global_tokens,) = all_reduce_sum([float(local_tokens)])
        denom = max(global_tokens, 1.0)
        for p in self.params:  # not the optimizer's zero_grad: a resume may still be restoring the optimizer
            p.grad = None
        # summed in fp64 where the losses are (python's float addition, without a host sync a micro-batch)
        local_loss, stats = torch.zeros((), dtype=torch.float64, device=self.device), LossStats()
        for k, b in enumerate(micro_batches):
            syncs = self.sync_every or k == len(micro_batches) - 1
            if self.sharded:  # reduce-scatter once, after the step's last micro-batch (or after each)
                set_gradient_sync(self.model, syncs)
            b = to_device(b, self.device)
            terms = loss(self._logprobs(self.model, b), b)
            # every tower parameter gets a gradient in the micro-batch that starts each one's accumulation
            # and in each that reduces: then every one reduces in the same dtype (fsdp.py, 1)
            touch = self.sharded and (syncs or k == 0)
            total = touch_towers(self.model, terms.total) if touch else terms.total
            (total / denom).backward()
            local_loss += terms.total.detach()
            stats.add(terms)
        self._phase_done("forward_backward")
        if not self.sharded:
            all_reduce_gradients(self.params)
        norm = grad_norm(self.params, sharded=self.sharded)
        clip_gradients(self.params, norm, self.train.grad_clip)
        self._phase_done("grad_norm_clip")
        self._restored()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        # the gradients are spent: freed now, not at the next step, so a rollout, refit or validation
        # between steps has their memory (the fit check counts none there)
        self.optimizer.zero_grad(set_to_none=True)
        trim()  # the step's freed host memory back to the kernel (host_memory.py)
        self._phase_done("optimizer")
        (total_loss,) = all_reduce_sum([float(local_loss)])
        return StepResult(
            loss=total_loss / denom,
            grad_norm=norm,
            lr=lr,
            valid_tokens=int(global_tokens),
            compute_s=time.perf_counter() - t0,
            peak_rss_mb=self._peak.peak_mb(),
            stats=stats.reduced(),
        )

    def _phase_done(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def _inputs(self, model: torch.nn.Module, batch) -> dict[str, torch.Tensor]:
        """The micro-batch's model inputs (a packed batch's: per-sequence position ids and no attention
        mask, models/packing.py), floating ones (pixels) in the compute dtype under mixed precision
        (some towers multiply their input with their weights without casting it)."""
        inputs = packed_inputs(model, batch) if getattr(batch, "is_packed", False) else batch.model_inputs()
        if self.sharding.mixed_precision != "bf16":
            return inputs
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}

    def _logprobs(self, model: torch.nn.Module, b) -> torch.Tensor:
        """`b`'s labelled tokens' log-probs under `model`, [B, T-1]: the LM head projects only the
        positions that score a labelled token (policy/loss.py); rows that show the same images (GRPO's
        responses to one prompt, `b.image_source`) read one vision pass (models/shared_images.py)."""
        inputs = self._inputs(model, b)
        # a packed batch may run as one row (flash-attention: models/packing.py), the same tokens in order
        keep = scored_positions(b.labels).reshape(inputs["input_ids"].shape)
        with vision_once(model, b.image_source):
            logits = model(**inputs, use_cache=False, logits_to_keep=logits_to_keep(keep)).logits
        return labelled_logprobs(kept_logits(logits, keep), b.labels)

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        """In train mode, as the training step's forward (dropout is 0 in every family's config): a model
        may take other kernels in eval mode (NemotronH's Mamba takes its fused kernel in train mode only),
        and GRPO's old and new log-probs must come from the same ones."""
        try:
            with self._scoring():
                return self._logprobs(self.model, to_device(batch, self.device)).cpu()
        finally:
            reshard_root(self.model)

    def _scoring(self):
        """A scoring forward's context: adapter dropout off (LoRA), nothing otherwise."""
        return no_adapter_dropout(self.model) if self.spec.lora is not None else contextlib.nullcontext()

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor:
        """The frozen reference's, in train mode too (`logprobs`). With LoRA the reference is the policy's
        own model with its adapters off: the base it trains on, with no second copy of the weights."""
        if self.spec.lora is not None:
            with adapters_off(self.model):
                return self.logprobs(batch)
        if getattr(self, "_reference", None) is None:
            self._reference = self._build_model(trainable=False).train()
        try:
            return self._logprobs(self._reference, to_device(batch, self.device)).cpu()
        finally:
            reshard_root(self._reference)

    def checkpoint_state(self) -> PolicyState:
        self._restored()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            allocate_state(self.optimizer)  # a resume's load target, without torch's zero-gradient step
            model, optimizer = get_state_dict(self.model, self.optimizer)
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        if self.spec.lora is not None:  # the base is the model's files, which the run identity fingerprints
            model = adapter_state(model)
        return PolicyState(
            Storage.SHARDED if self.sharded else Storage.REPLICATED,
            {MODEL_PART: model, OPTIMIZER_PART: {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}},
        )

    def load_checkpoint_state(self, state: PolicyState) -> None:
        model, optimizer = state.parts.get(MODEL_PART), state.parts.get(OPTIMIZER_PART)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

            if model is not None:
                set_model_state_dict(self.model, model, options=self._load_options())
            if optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, optimizer["optimizer"])
        else:
            if model is not None and self.spec.lora is not None:
                load_adapters(self.model, model)  # the adapters; the base stays as read from the model's files
            elif model is not None:
                self.model.load_state_dict(model)
            if optimizer is not None:
                self.optimizer.load_state_dict(optimizer["optimizer"])
        if optimizer is not None:
            self.scheduler.load_state_dict(optimizer["scheduler"])

    def _load_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(strict=self.spec.lora is None)  # LoRA: the adapters, the base stays as read

    def load_checkpoint_state_later(self, read: Callable[[], PolicyState]) -> None:
        """`read` on a thread of this process (interface doc): it fills the state's tensors; the state is
        applied here, in the caller's thread, where `train_step` waits for it (before the optimizer's
        step) or `checkpoint_state` does. Never applied on the thread: FSDP2 swaps the modules'
        parameters for unsharded ones during a forward, which the optimizer's state is mapped through."""
        self._restored()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrun-restore")
        self._restoring = pool.submit(read)
        pool.shutdown(wait=False)  # the thread ends with the work

    def _restored(self) -> None:
        """Apply what a `load_checkpoint_state_later` read, once its read is done; raises what it raised."""
        restoring, self._restoring = getattr(self, "_restoring", None), None
        if restoring is not None:
            self.load_checkpoint_state(restoring.result())

    def generation_model(self) -> torch.nn.Module:
        """The policy's own model (FSDP2 units or whole): the hf engine generates with it (interface doc)."""
        return self.model

    def weights_for_refit(
        self, *, dtype: str | None = None, bucket_bytes: int = REFIT_BUCKET_BYTES, into=None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights by HF name, bucket by bucket, on this rank's device (interface doc). Sharded:
        each tensor is cast on its shard and gathered alone into the whole tensor, every rank in the same
        order (refit_stream.py), so a refit holds one bucket of whole tensors, in `dtype`, never the model.
        Replicated: the live tensors themselves (cast copies when `dtype` differs). `into`: written into
        the engine's own tensors where they fit (refit_stream.py, 3)."""
        want = None if dtype is None else torch_dtype(dtype)
        if self.spec.lora is not None:  # the base's names, each wrapped weight merged as its layer is drawn
            tensors = merged_tensors(self.model, lambda t: whole(t, t.dtype, max(1, bucket_bytes // SLICES_PER_BUCKET)))
            return refit_buckets(tensors, want, bucket_bytes, into)
        return refit_buckets(state_tensors(self.model), want, bucket_bytes, into)

    def offload_to_host(self, parts: tuple[str, ...]) -> int:
        """The parts' tensors on this rank's device (host_offload.py): the model part is the policy's
        parameters and buffers and its reference model's; the optimizer part its state (the gradients
        are freed at each optimizer step already). Offloaded shards (parallel.cpu_offload) stay."""
        unknown = set(parts) - set(POLICY_PARTS)
        if unknown:
            raise ValueError(f"parts {sorted(unknown)} are not policy parts ({', '.join(POLICY_PARTS)})")
        self._restored()  # a resume's optimizer part is applied before it moves
        if getattr(self, "_host", None) is None:
            self._host = HostCopies()
        tensors: list[torch.Tensor] = []
        if MODEL_PART in parts:
            for model in (self.model, getattr(self, "_reference", None)):
                if model is not None:
                    tensors += [*model.parameters(), *model.buffers()]
        if OPTIMIZER_PART in parts:
            tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return self._host.move(tensors, self.device)

    def restore_from_host(self) -> int:
        host, self._host = getattr(self, "_host", None), None
        return host.restore() if host is not None else 0

    def export(self, read: Callable[[PolicyState], PolicyState], out: Path, *, adapter: bool = False) -> None:
        """A Hugging Face model directory of the checkpoint `read` fills (policy/hf_export.py): the trained
        weights or, for a LoRA run, the base merged with its adapters, or with `adapter` the peft adapter
        directory that peft loads onto the base."""
        hf_export.export(self.spec, read, out, adapter=adapter)

    def shutdown(self) -> None:
        """Drop the model, its reference copy and the optimizer, then leave the process group: nothing
        may hold the group past its destroy (an FSDP module or device mesh still alive at interpreter
        exit can abort the process there in gloo's destructors)."""
        restoring, self._restoring = getattr(self, "_restoring", None), None
        if restoring is not None:
            restoring.exception()  # waits; what it raised was the step's to report
        for name in ("model", "_reference", "params", "optimizer", "scheduler"):
            self.__dict__.pop(name, None)
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
