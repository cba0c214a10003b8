"""The parallel layout of the policy's ranks: the recipe's `parallel` section and the one layout type
the topology mapper, the worker group and the checkpoints use."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from vlmrun.config.section import Section


class ParallelConfig(Section):
    """Data, tensor, pipeline and context parallel sizes; experts live inside dp x tp.

    Frozen and keyword-only; each size is an integer >= 1 (`true` is not 1: a ValidationError names
    the size).
    """

    model_config = ConfigDict(frozen=True)

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        """One line for error messages, e.g. "dp=2 tp=1 pp=1 cp=1 (2 ranks)"."""
        ranks = "rank" if self.world_size == 1 else "ranks"
        return f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} ({self.world_size} {ranks})"
