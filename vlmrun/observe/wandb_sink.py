"""Mirror metrics rows into an offline wandb run (metrics.jsonl stays the source of truth).

wandb's offline history lives only in its binary run file, so nothing of ours reads it back. Any
wandb failure is logged and ignored: a logger must never stop training.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)


class WandbSink:
    def __init__(self, *, mode: str, project: str, run_dir: Path, name: str, run_id: str):
        self.run = None
        if mode == "disabled":
            return
        try:
            import wandb

            self.run = wandb.init(
                mode=mode,
                project=project,
                dir=str(run_dir),
                name=name,
                id=run_id,
                resume="allow",
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
        except Exception as e:  # noqa: BLE001 - logging must not end the run
            log.warning("wandb disabled for this attempt: %s", e)

    def log(self, row: dict) -> None:
        if self.run is None:
            return
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        try:
            self.run.log(numbers, step=row["step"])
        except Exception as e:  # noqa: BLE001
            log.warning("wandb log failed, disabling: %s", e)
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()  # writes the offline run's summary and closes its file
            except Exception as e:  # noqa: BLE001 - logging must not end the run
                log.warning("wandb finish failed: %s", e)
            self.run = None


def wandb_id(run_dir: Path) -> str:
    """One wandb run per run directory, so resumed attempts append to it."""
    return hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
