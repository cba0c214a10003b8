"""Config of the data path: which Energon dataset, how it is cooked, encoded and loaded."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.families import Family
from vlmrun.config.section import Section


class SyntheticClevr(Section):
    """Generate a synthetic CLEVR-style set at `data.path` on first use when it is missing."""

    train: int = Field(1024, ge=1)
    val: int = Field(128, ge=1)
    image_size: int = Field(112, ge=32, le=1024)
    seed: int = 0


class DataConfig(Section):
    path: str = Field(description="Energon dataset directory (prepared: has .nv-meta/)")
    split: str = "train"
    val_split: str = "val"
    family: Family | None = Field(None, description="model family the task encoder targets; defaults to model.family")
    cookers: list[str] = Field(default_factory=lambda: ["conversation"])
    task_encoder: str = "chat_sft"
    num_workers: int = Field(1, ge=0, le=64)
    shuffle_buffer: int = Field(64, ge=0)
    max_samples_per_sequence: int = Field(64, ge=1)
    transfer_samples: int = Field(
        8,
        ge=1,
        le=256,
        description=(
            "samples per trip from a loader worker to the training process, rounded down to whole micro-batches: "
            "more spreads the per-trip cost; each worker keeps 4 trips of shared memory"
        ),
    )
    virtual_epoch_length: int = Field(0, ge=0, description="samples per epoch per shard; 0 = the split's size")
    max_seq_len: int = Field(
        1024,
        ge=16,
        description="tokens per sample, media included: a GRPO or validation prompt must fit whole; a longer "
        "SFT conversation is cut at this length when its media and a labelled token stay in (else: on_bad_sample)",
    )
    pack_tokens: int | None = Field(
        None,
        ge=16,
        description="each micro-batch's sequences packed end to end into rows of at most this many tokens "
        "instead of a padded row each (the same samples per micro-batch; each sequence attends to itself only, "
        "its own positions): SFT's conversations (at least data.max_seq_len), GRPO's prompt-and-response "
        "sequences in its logprob and train stages (at least data.max_seq_len + grpo.max_new_tokens). "
        "Qwen-VL families; None: padded rows",
    )
    pack_by: Literal["samples", "tokens"] = Field(
        "samples",
        description="with data.pack_tokens: samples keeps train.micro_batch_size samples per micro-batch; tokens "
        "lays each rank's samples of a step out again as micro-batches of one row of at most data.pack_tokens "
        "tokens each, as few as the rank that needs the most takes, the same number on every rank (SFT, and "
        "GRPO's logprob and train stages with grpo.inner_steps 1; the step's samples, their order and the loss "
        "are unchanged)",
    )
    on_bad_sample: Literal["refuse", "drop"] = Field(
        "refuse",
        description="a sample the run cannot train on (longer than data.max_seq_len where no cut keeps its media "
        "and an answer token, no labelled token, image tokens that do not match its images): refuse fails the "
        "run (at submit, by `vlmrun data check`, where the data and model are there) naming it and why; drop "
        "skips it, counted (the `dropped_samples` metric) within error_tolerance",
    )
    check_at_submit: bool = Field(
        True,
        description="`vlmrun submit` checks every sample of the splits the run reads against the recipe "
        "(vlmrun data check) where data.path is a prepared set; the result is cached per data set, processor "
        "and data settings, so a second submit does not check again",
    )
    error_tolerance: int = Field(16, ge=0, description="corrupt (or dropped) samples skipped per shard before failing")
    synthetic: SyntheticClevr | None = None
