"""Config of the training loop and of checkpointing."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from vlmrun.config.section import Section

# Adam's moment decay rates: 1 would never forget, and torch refuses anything outside [0, 1).
Beta = Annotated[float, Field(ge=0, lt=1)]


class TrainConfig(Section):
    algorithm: Literal["sft", "grpo"] = "sft"
    loop: Literal["v1", "v2"] = "v2"
    global_batch_size: int = Field(8, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    max_steps: int = Field(100, ge=1)
    epochs: int = Field(1, ge=1)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 = no clipping")
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    seed: int = 1234
    val_period: int = Field(0, ge=0, description="validate every N steps; 0 = only at the end")
    val_samples: int = Field(64, ge=0, description="val samples scored per validation; 0 = no validation")
    stop_after: int | None = Field(
        None,
        ge=1,
        description="stop this attempt at the step boundary after this step, checkpointed and resumable "
        "(state STOPPED, exit 3); for one attempt only: a resume trains on unless it sets it again",
    )


class RequeueBudget(Section):
    """How many times SLURM may requeue the job, counted separately for time limits and preemptions."""

    timeouts: int = Field(3, ge=0)
    preemptions: int = Field(3, ge=0)


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="default: <run dir>/checkpoints")
    save_period: int = Field(50, ge=0, description="save every N steps; 0 = only when stopping and at the end")
    keep: int = Field(2, ge=1)
    requeue: RequeueBudget = Field(default_factory=RequeueBudget)
    restart_data_order: bool = Field(
        False,
        description="resume from a checkpoint of another parallel.dp: keep model, optimizer and counters, "
        "start the data order over (set by `vlmrun resume --restart-data-order`)",
    )
    async_save: bool = Field(
        False,
        description="write the policy's state in the background while the next steps train: a step waits "
        "only for a copy of it in host memory; the checkpoint is sealed (and counts) once every rank's "
        "files are written, so a kill before that leaves the previous one the newest valid",
    )
