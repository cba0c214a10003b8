"""What `submit` and `resume` return to the CLI, whichever cluster ran the job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrun.models.fit import MemoryFit


@dataclass
class SubmitResult:
    run_dir: Path
    cluster: str
    dry_run: bool
    rendered: str = ""  # the resolved recipe (YAML) of a dry run
    script: str = ""  # and, for SLURM, the exact sbatch script it would submit
    job_id: str | None = None
    state: str | None = None
    exit_code: int = 0
    memory: MemoryFit | None = None  # submit's memory estimate (models/fit.py)
    changes: list[str] | None = None  # what a resume changed: `field: old -> new` each
    steps: Any = None  # submit's StepPlan (algorithms/common/steps.py), None where the split is not here

    def summary(self) -> dict:
        out = {"run_dir": str(self.run_dir), "cluster": self.cluster, "dry_run": self.dry_run}
        if self.job_id is not None:
            out["job_id"] = self.job_id
        if self.state is not None:
            out["state"] = self.state
        if self.memory is not None:
            out["memory_estimate"] = self.memory.to_json()
        if self.changes:
            out["changes"] = self.changes
        if self.steps is not None:
            out["steps"] = {"max_steps": self.steps.max_steps, "steps_per_epoch": self.steps.steps_per_epoch}
            if self.steps.capped:
                out["steps"]["capped_by"] = self.steps.cap_advice()
        if self.dry_run:
            out["recipe"] = self.rendered
            if self.script:
                out["sbatch_script"] = self.script
        return out
