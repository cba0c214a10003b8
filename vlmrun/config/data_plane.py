"""Config of the data plane that carries bulk tensors between stages."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class DataPlaneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    impl: Literal["local", "transfer_queue"] = "local"
    backend: Literal["simple", "mooncake"] = "simple"

    @model_validator(mode="after")
    def _backend_needs_tq(self) -> DataPlaneConfig:
        if self.impl == "local" and self.backend != "simple":
            raise ValueError("backend 'mooncake' needs data_plane.impl: transfer_queue")
        return self
