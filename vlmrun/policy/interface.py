"""The policy seam: what any training backend offers the algorithms, one instance per rank.

Algorithms (SFT, GRPO) call only these methods; a backend (`hf`: a full replica per rank, or FSDP2
shards, on gloo/CPU or NCCL/GPU; `megatron`: megatron-core's GPTModel with the HF vision tower, tensor
and pipeline parallel, every rank of a replica running the replica's micro-batches) implements them, and `vlmrun.policy.open_policy`
is the one way to get one (keyed on `model.backend`). The instance lives inside its rank's worker
actor; collectives between ranks happen inside the calls, so every rank must make the same calls in
the same order (as with torch.distributed itself).

1. `setup` joins the ranks' process group and builds model, optimizer and LR schedule.
2. `train_step` takes this rank's micro-batches of one optimizer step and a `TokenLoss` (SFT's NLL by
   default; GRPO's clipped policy gradient): the loss is summed over tokens and normalized by the
   step's global count of them (all ranks), so replicas and loops agree bitwise.
3. `logprobs` scores a batch under the current weights (GRPO's prev logprobs, validation's NLL);
   `reference_logprobs` under the initial weights (GRPO's KL penalty).
4. `checkpoint_state` / `load_checkpoint_state`: the backend's share of a checkpoint as a
   `PolicyState`, whose `storage` says how it is written (one copy for all ranks, or every rank its
   shard, together); the checkpoint store writes and reads it in one call and decides where it goes.
   A resume may restore the weights now and the optimizer part while the first step's forward and
   backward run (`load_checkpoint_state_later`): AdamW's moments are two thirds of the bytes.
5. `weights_for_refit`: the full weights, by HF parameter name, streamed to a generation engine in
   buckets of whole tensors (`REFIT_BUCKET_BYTES`), each gathered from the shards only when its bucket
   is drawn: a refit never holds a second whole model (collective when sharded, or tensor or pipeline
   parallel: every rank draws every bucket, in order; under tp/pp the buckets hold the tensors on the
   ranks where `receives_refit` is true, each replica's first rank, and are empty on the others).
6. `export`: the trained weights as a model directory a recipe's `model.path` can name.
7. `offload_to_host` / `restore_from_host`: parts of the policy's state moved to host memory while a
   generation engine uses the device (GRPO's rollout, `parallel.offload_during_generation`), and back.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrun.checkpoint.parts import PolicyState

#: The default refit bucket (the recipe's generation.refit_bucket_mb says it per run).
REFIT_BUCKET_BYTES = 256 << 20
#: The phases of `train_step` that `PolicyBackend.on_phase` reports: forward and backward of every
#: micro-batch (a sharded policy's gradient reduce-scatter included), the gradient sum across replicas
#: with the norm and the clipping, the optimizer and LR schedule step.
TRAIN_PHASES = ("forward_backward", "grad_norm_clip", "optimizer")


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as every rank saw it (identical on all ranks)."""

    loss: float  # summed NLL over the step's valid tokens / global valid tokens
    grad_norm: float  # before clipping
    lr: float  # the LR this step's update used
    valid_tokens: int  # global, all ranks
    compute_s: float  # this rank's forward + backward + step time
    peak_rss_mb: float  # this rank's process and its children
    stats: dict[str, float] = field(default_factory=dict)  # the loss's statistics, reduced over all ranks


@dataclass
class LossTerms:
    """One micro-batch's part of a `TokenLoss`: `total` is the tensor to backpropagate (summed over the
    micro-batch's tokens, not normalized); `sums`, `mins` and `maxs` are statistics the backend reduces
    over every micro-batch of every rank by sum, min and max (every call returns the same keys): floats,
    or 0-d tensors where they were computed, which the backend brings to the host once a step."""

    total: Any
    sums: dict[str, Any] = field(default_factory=dict)
    mins: dict[str, Any] = field(default_factory=dict)
    maxs: dict[str, Any] = field(default_factory=dict)


class TokenLoss(abc.ABC):
    """A loss summed over tokens and divided by the step's global count of them (every rank's micro-batches).

    Micro-batches are whatever the algorithm passes to `train_step`; they must offer `model_inputs()`,
    `labels` ([B, T], IGNORE_INDEX where no token is scored: the policy projects only the others) and
    `image_source` (None, or which rows show the same images: data/batch.py's `Batch`).
    """

    @abc.abstractmethod
    def tokens(self, micro_batch) -> int:
        """How many of the micro-batch's tokens carry loss (the global count is their sum over ranks)."""

    @abc.abstractmethod
    def __call__(self, logprobs, micro_batch) -> LossTerms:
        """The micro-batch's loss terms from its tokens' log-probs under the policy, [B, T-1] float32
        (position t scores token t + 1; 0 where the micro-batch's labels carry none: the policy
        projects only the labelled positions onto the vocabulary, policy/loss.py)."""


class PolicyBackend(abc.ABC):
    """A model being trained on one rank; see the module docstring for the contract."""

    #: For measurements (tools/gpu/check.py times a step's phases): when set, `train_step` calls it with
    #: each phase's name as the phase ends (TRAIN_PHASES, in order); None in training.
    on_phase: Callable[[str], None] | None = None
    #: Whether this rank's refit buckets hold the weights (its replica's engine lives here); a backend
    #: whose every rank is its own replica holds them everywhere.
    receives_refit: bool = True

    @abc.abstractmethod
    def setup(self, *, master_addr: str, master_port: int, max_steps: int, weights: str = "load") -> dict[str, Any]:
        """Join the process group and build model, optimizer and schedule; returns {rank, params (this
        rank's count), device, layout, load (how the weights were read: job.json's policy_load)}.
        `weights`: "load" (from the model's source) or "checkpoint" (allocated, not read: the caller
        fills every parameter and persistent buffer from a checkpoint next, `load_checkpoint_state`)."""

    @abc.abstractmethod
    def load_model_weights(self) -> None:
        """After `setup(weights="checkpoint")` when no checkpoint is loaded after all: the model,
        optimizer and schedule as `setup(weights="load")` makes them."""

    @abc.abstractmethod
    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        """Forward/backward over this rank's micro-batches with `loss` (None: the NLL of `labels`),
        reduce gradients across ranks, step."""

    @abc.abstractmethod
    def logprobs(self, batch) -> Any:
        """log p(next token) per position, [B, T-1], float32; 0 where labels are ignored."""

    @abc.abstractmethod
    def reference_logprobs(self, batch) -> Any:
        """`logprobs` under the initial weights (what the backend was built from), never trained."""

    @abc.abstractmethod
    def checkpoint_state(self) -> PolicyState:
        """Every part of POLICY_PARTS as this rank holds it (its shards, when sharded): what a checkpoint
        saves, and the structure a checkpoint is read into (a sharded read loads into it in place)."""

    @abc.abstractmethod
    def load_checkpoint_state(self, state: PolicyState) -> None:
        """Restore what `checkpoint_state` returned (as the checkpoint store read it back), or some of
        its parts."""

    def load_checkpoint_state_later(self, read: Callable[[], PolicyState]) -> None:
        """`load_checkpoint_state(read())`, `read` running while the caller goes on; the backend applies
        what it read before anything that needs those parts (and raises there what it raised). `read`
        must not use the process group the steps use, nor the model. This default restores now."""
        self.load_checkpoint_state(read())

    def generation_model(self) -> Any:
        """The model a generation engine may generate with in place of a copy of its own (the hf engine,
        `open_generator(weights="policy")`), or None where the backend's model cannot (the default)."""
        return None

    @abc.abstractmethod
    def weights_for_refit(
        self, *, dtype: str | None = None, bucket_bytes: int = REFIT_BUCKET_BYTES, into: Mapping | None = None
    ) -> Iterator[dict]:
        """The full weights as buckets {parameter name: whole tensor} of at most `bucket_bytes` each (a
        larger tensor alone), in the recipe dtype `dtype` (None: the policy's own), on the policy's
        device; every name once, over all buckets. A bucket is read before the next is drawn and may
        view the live weights: the consumer copies it (`GenerationBackend.load_weights`). `into`
        (`GenerationBackend.refit_targets`): a weight whose target there has its shape and dtype is
        written into that target, and the bucket carries the target itself."""

    @abc.abstractmethod
    def offload_to_host(self, parts: tuple[str, ...]) -> int:
        """Move `parts` (of POLICY_PARTS: the weights, with the reference model's; the optimizer's state)
        to host memory, freeing their device memory; returns the bytes moved. Nothing of them may be
        used until `restore_from_host` (a refit between the optimizer's move and the weights' is fine)."""

    @abc.abstractmethod
    def restore_from_host(self) -> int:
        """Everything `offload_to_host` moved back on the device, unchanged; returns the bytes."""

    @abc.abstractmethod
    def export(self, read: Callable[[PolicyState], PolicyState], out: Path) -> None:
        """Write a model directory to `out` whose weights `read` fills: it gets the model part as a
        one-process state and returns it loaded (a checkpoint's `read_policy`). One process, no process
        group, no `setup` needed."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the process group; the instance is unusable afterwards."""
