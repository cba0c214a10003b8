"""The policy seam: what any training backend offers the algorithms, one instance per rank.

Algorithms (SFT, GRPO) call only these methods; a backend (`hf`: a full replica per rank, or FSDP2
shards, on gloo/CPU or NCCL/GPU; megatron-core later) implements them. The instance lives inside its rank's worker actor;
collectives between ranks happen inside the calls, so every rank must make the same calls in the same
order (as with torch.distributed itself).

1. `setup` joins the ranks' process group and builds model, optimizer and LR schedule.
2. `train_step` takes this rank's micro-batches of one optimizer step and a `TokenLoss` (SFT's NLL by
   default; GRPO's clipped policy gradient): the loss is summed over tokens and normalized by the
   step's global count of them (all ranks), so replicas and loops agree bitwise.
3. `logprobs` scores a batch under the current weights (GRPO's prev logprobs, tests);
   `reference_logprobs` under the initial weights (GRPO's KL penalty).
4. `state_dict` / `load_state_dict`: the parts of a checkpoint this backend owns, by part name
   (`CHECKPOINT_PARTS`); the checkpoint store decides where they go. A `sharded_state` backend
   returns this rank's shards (DTensors), which every rank saves and loads together through DCP.
5. `weights_for_refit`: the full weights, by parameter name, for a generation engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

#: Part names a policy's state_dict holds; the checkpoint store maps each to a file.
CHECKPOINT_PARTS = ("model", "optimizer")


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
    over every micro-batch of every rank by sum, min and max (every call returns the same keys)."""

    total: Any
    sums: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)


class TokenLoss(abc.ABC):
    """A loss summed over tokens and divided by the step's global count of them (every rank's micro-batches).

    Micro-batches are whatever the algorithm passes to `train_step`; they must offer `model_inputs()`.
    """

    @abc.abstractmethod
    def tokens(self, micro_batch) -> int:
        """How many of the micro-batch's tokens carry loss (the global count is their sum over ranks)."""

    @abc.abstractmethod
    def __call__(self, logits, micro_batch) -> LossTerms:
        """The micro-batch's loss terms from the model's logits [B, T, vocab]."""


class PolicyBackend(abc.ABC):
    """A model being trained on one rank; see the module docstring for the contract."""

    #: False when every rank's state_dict is the same (replicas): rank 0 alone saves it for all; True
    #: when each rank holds a shard of it: every rank saves its own, together.
    sharded_state: bool = False

    @abc.abstractmethod
    def setup(self, *, master_addr: str, master_port: int, max_steps: int) -> dict[str, Any]:
        """Join the process group and build model, optimizer and schedule; returns {rank, params}."""

    @abc.abstractmethod
    def train_step(self, micro_batches: list, loss: TokenLoss | None = None) -> StepResult:
        """Forward/backward over this rank's micro-batches with `loss` (None: the NLL of `labels`),
        reduce gradients across ranks, step."""

    @abc.abstractmethod
    def logprobs(self, batch) -> Any:
        """log p(next token) per position, [B, T-1], float32; 0 where labels are ignored."""

    @abc.abstractmethod
    def reference_logprobs(self, batch) -> Any:
        """`logprobs` under the initial weights (the model directory's), never trained."""

    @abc.abstractmethod
    def score(self, loss_batches: list, prompt_batches: list) -> list[float]:
        """Validation over this rank's batches: [nll sum, tokens, correct, answered]; the caller sums ranks."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """{part: state} for every part of CHECKPOINT_PARTS (plain tensors and containers)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    @abc.abstractmethod
    def weights_for_refit(self) -> dict[str, Any]:
        """Parameter name -> full tensor, for a generation engine to load."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the process group; the instance is unusable afterwards."""
