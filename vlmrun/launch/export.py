"""`vlmrun export`: a run's checkpoint as a Hugging Face model directory that a recipe's `model.path` can name.

1. The checkpoint is read through the run's checkpoint store (the newest one of this run that
   verifies, or `--step N`, which must verify too), held for the whole export so that a run that is
   training cannot delete it under the export (`CheckpointStore.reading`); newer, damaged ones are
   named in the result (`skipped`), never passed over in silence. Its policy's model part is the full
   state_dict by HF parameter name, or, from a sharded (FSDP2) run, the model's entries of the DCP
   checkpoint, assembled from every rank's shard in this one process (`Checkpoint.read_policy`).
2. The run's policy backend (`vlmrun.policy.open_policy`, the recipe's `model.backend`) writes the
   directory: the run's own model directory (`ensure_model`: the tiny model in the run's cache, or
   `model.path`) gives the architecture, the processor, the tokenizer and the chat template; the
   checkpoint's weights go into that architecture in the run's `model.dtype`, so the export's logits
   equal those of the trained model bit for bit.
3. A LoRA run's checkpoint holds its adapters; its export is the model directory's base merged with them
   (W + scale * B @ A, the refit's merge), or with `--adapter` the adapters as peft writes them
   (adapter_config.json, adapter_model.safetensors), for `PeftModel.from_pretrained(base, OUT)`.
4. OUT is written as a hidden sibling folder and renamed into place: a reader never sees half an
   export, and a failed export leaves nothing. OUT must not exist or be empty.

Login-node side, like the rest of `launch`: torch and transformers are imported when an export runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vlmrun.checkpoint.manifest import CorruptCheckpoint
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.checkpoint.store import CheckpointStore, MissingCheckpoint, run_checkpoints
from vlmrun.errors import InputError
from vlmrun.models.source import ensure_model
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy
from vlmrun.run.directory import RunDirectory

#: Written next to the model: where the export came from (no loader reads it).
EXPORT_RECORD = "vlmrun_export.json"


@dataclass(frozen=True)
class Export:
    """What `export_checkpoint` wrote: the folder, the step it holds, its files (relative, sorted) and a
    line for each newer checkpoint that was damaged and skipped."""

    out: Path
    step: int
    files: list[str]
    skipped: list[str]

    def summary(self) -> dict:
        return {"out": str(self.out), "step": self.step, "files": self.files, "skipped": self.skipped}


def export_checkpoint(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, adapter: bool = False
) -> Export:
    """Write checkpoint `step` of the run at `run_dir` (default: the newest that verifies) to `out`; with
    `adapter`, a LoRA run's adapters as a peft adapter directory (3).

    Raises InputError naming RUN_DIR (not a run directory, no complete checkpoint), --step (no such
    checkpoint: the message lists the steps there are; or it does not verify), OUT (not empty) or
    --adapter (the run trained no adapters).
    """
    rd = RunDirectory(run_dir)
    if not rd.exists():
        raise InputError("RUN_DIR", str(rd.path), message=f"RUN_DIR: {rd.path} is not a run directory (no recipe.yaml)")
    recipe = rd.load_recipe()
    lora = recipe.model.lora
    if adapter and lora is None:
        raise InputError("--adapter", True, message=f"--adapter: {rd.path} trained every weight (no model.lora)")
    out = Path(out).expanduser().resolve()
    _check_out(out)
    with contextlib.ExitStack() as held:
        checkpoint, skipped = _hold_checkpoint(held, run_checkpoints(rd, recipe, assign=False), step, rd)
        model_dir = ensure_model(recipe.model, rd.cache, recipe.train.seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            policy = open_policy(
                recipe.model.backend,
                model=ModelSpec(
                    directory=str(model_dir),
                    dtype=recipe.model.dtype,
                    lora=lora.model_dump() if lora is not None else None,
                ),
                rank=0,
                world_size=1,
                train=recipe.train,
            )
            policy.export(checkpoint.read_policy, tmp, **({"adapter": True} if adapter else {}))
            _publish(tmp, out, rd, checkpoint, recipe, model_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return Export(out=out, step=checkpoint.step, files=files, skipped=skipped)


def _publish(tmp: Path, out: Path, rd: RunDirectory, checkpoint: Checkpoint, recipe, model_dir: Path) -> None:
    """The export record beside the model, then `tmp` renamed to `out`: readers never see half an export."""
    record = {"run_dir": str(rd.path), "step": checkpoint.step, "family": recipe.family, "model_dir": str(model_dir)}
    (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    tmp.chmod(0o755)  # mkdtemp makes it private to this user
    if out.exists():
        out.rmdir()  # empty: checked before
    os.rename(tmp, out)


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise InputError("OUT", str(out), message=f"OUT: {out} exists and is not empty; name a new folder")


def _hold_checkpoint(
    held: contextlib.ExitStack, store: CheckpointStore, step: int | None, rd: RunDirectory
) -> tuple[Checkpoint, list[str]]:
    """(checkpoint, skipped) to export, held until `held` closes (CheckpointStore.reading); no such
    checkpoint, or a damaged `step`, is an InputError naming the argument."""
    try:
        return held.enter_context(store.reading(step))
    except MissingCheckpoint as e:
        if step is None:
            why = f" ({'; '.join(e.skipped)})" if e.skipped else ""
            raise InputError(
                "RUN_DIR", str(rd.path), message=f"RUN_DIR: {rd.path} has no complete checkpoint{why}"
            ) from None
        steps = [s for s, _ in store.complete()]
        there = f"steps {', '.join(map(str, steps))}" if steps else "none"
        raise InputError(
            "--step", step, message=f"--step: {rd.path} has no checkpoint of step {step}; there are: {there}"
        ) from None
    except CorruptCheckpoint as e:
        others = ", ".join(str(s) for s, _ in store.complete() if s != step) or "none"
        raise InputError(
            "--step", step, message=f"--step: checkpoint step {step} is damaged ({e}); other steps: {others}"
        ) from None
