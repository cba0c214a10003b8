"""Config of metrics and loggers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoggerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "vlmrun"
    metrics_file: str = Field("metrics.jsonl", pattern=r"^[A-Za-z0-9._-]+$")
