"""Config of metrics and loggers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.section import Section


class LoggerConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "vlmrun"
    metrics_file: str = Field(
        "metrics.jsonl",
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$",
        max_length=255,
        description="a file name in the run directory, not one the run directory uses itself (run/directory.py)",
    )
