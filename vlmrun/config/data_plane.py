"""Config of the data plane that carries bulk tensors between stages."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vlmrun.config.section import Section


class DataPlaneConfig(Section):
    """`enabled: false` runs GRPO with every batch through the driver instead (for A/B runs): no plane
    servers start, and `impl` and `backend` are not used."""

    enabled: bool = Field(True, description="GRPO: move the rollout through the data plane (false: via the driver)")
    impl: Literal["local", "transfer_queue"] = "local"
    backend: Literal["simple", "mooncake"] = "simple"

    @model_validator(mode="after")
    def _backend_needs_tq(self) -> DataPlaneConfig:
        if self.impl == "local" and self.backend != "simple":
            raise ValueError("backend 'mooncake' needs data_plane.impl: transfer_queue")
        return self
