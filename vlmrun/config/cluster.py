"""Config of where a run executes: the SLURM allocation and the container around it."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from vlmrun.config.section import Section
from vlmrun.errors import short_repr

# SLURM names (partition, account, qos) are plain words; refusing anything else keeps them out of
# shell and sbatch parsing trouble even before the renderer quotes them.
_SLURM_NAME = r"^[A-Za-z0-9_.,+-]+$"
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(value: int | str) -> int:
    """A SLURM time limit -> whole minutes (>= 1; seconds round up). The one parser of SLURM times.

    SLURM's forms: `M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`; an int is minutes. Raises
    ValueError for anything else (the caller decides what "unlimited" means).
    """
    if isinstance(value, bool):
        raise ValueError("a time limit is minutes or a SLURM time string, not a boolean")
    if isinstance(value, int):
        minutes = value
    else:
        m = _TIME.match(str(value).strip())
        if not m:
            raise ValueError("use minutes (60), HH:MM:SS (01:00:00) or D-HH:MM:SS (1-00:00:00)")
        days, a, b, c = m.groups()
        if days is not None:
            hours, mins, secs = int(a), int(b or 0), int(c or 0)
        elif c is not None:
            hours, mins, secs = int(a), int(b), int(c)
        else:  # `M` or `M:S`, as sbatch reads them
            hours, mins, secs = 0, int(a), int(b or 0)
        minutes = int(days or 0) * 1440 + hours * 60 + mins + (1 if secs else 0)
    if minutes < 1:
        raise ValueError("must be at least 1 minute")
    return minutes


class ClusterConfig(Section):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, le=16)
    cpus_per_node: int = Field(2, ge=1)
    mem_gb: int | None = Field(None, ge=1, description="memory per node; default: the partition's")
    gpu_memory_gb: int = Field(
        80,
        ge=1,
        le=4096,
        description="memory of one GPU of the partition as its name gives it (80 for an H100 80GB); the "
        "memory-fit check at submit counts what such a device offers: 99.56% of that in GiB (79.6 GiB)",
    )
    partition: str | None = Field(None, pattern=_SLURM_NAME)
    account: str | None = Field(None, pattern=_SLURM_NAME)
    qos: str | None = Field(None, pattern=_SLURM_NAME)
    time_limit: int = Field(60, description="minutes; HH:MM:SS and D-HH:MM:SS are accepted")
    signal_delay_s: int = Field(120, ge=10, description="seconds before the time limit that USR2 arrives")
    job_name: str | None = None
    container_image: str | None = None
    container_mounts: list[str] = Field(default_factory=list)
    sbatch_template: str = "default"
    env: dict[str, str] = Field(default_factory=dict, description="environment variables set on every node")
    modules: list[str] = Field(default_factory=list, description="`module load` names")
    extra_sbatch_args: dict[str, str] = Field(default_factory=dict)
    extra_srun_args: list[str] = Field(default_factory=list)

    @property
    def threads_per_gpu_rank(self) -> int:
        """CPU threads a GPU rank computes with: the node's CPUs shared by its GPUs' ranks (a GPU rank's
        host side: parallel.cpu_offload's optimizer step and gradient norm, batch preparation)."""
        return max(1, self.cpus_per_node // max(1, self.gpus_per_node))

    @field_validator("time_limit", mode="before")
    @classmethod
    def _minutes(cls, value):
        return parse_time_limit(value)

    @field_validator("env")
    @classmethod
    def _env_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_KEY.match(key):
                raise ValueError(f"environment variable name {short_repr(key)} must match [A-Za-z_][A-Za-z0-9_]*")
        return value

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node
