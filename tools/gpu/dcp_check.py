"""DCP resume: save a sharded model and its AdamW state after one step, load both into a fresh model built
from another seed, and take the same next step on each: the losses and parameters must be bitwise equal.

1. The section runs under `torch.use_deterministic_algorithms(True)` (flash attention's backward
   otherwise accumulates dQ in any order; cuBLAS needs CUBLAS_WORKSPACE_CONFIG, which check.py sets
   before CUDA starts). Where an op has no deterministic kernel and raises, the section runs again with
   `warn_only=True`, says so in `determinism` (with the op), and then accepts parameters within
   WARN_ONLY_TOLERANCE: kernel noise moves a 0.02-sized fp32 weight by a few ulps (~1e-8), an optimizer
   state that did not load moves it by about the learning rate (1e-5).
2. `loaded_state_equal` (the parameters right after load against those saved) tells a load that went
   wrong from a kernel that is not deterministic; the next loss comes from a forward pass alone and must
   be bitwise equal in either mode.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import workload
from train_check import PhaseClock, sharded_model, train_step

from vlmrun.policy.fsdp import local_tensor

WARN_ONLY_TOLERANCE = 1e-7


@contextlib.contextmanager
def deterministic(caught: list[str], *, warn_only: bool) -> Iterator[None]:
    """Deterministic algorithms for the duration (restored after); the distinct determinism warnings go
    into `caught`."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    caught.extend(sorted({str(r.message).split("\n")[0][:200] for r in records if _is_determinism(r)}))


def _is_determinism(record: warnings.WarningMessage) -> bool:
    text = str(record.message)
    return "deterministic" in text or "CUBLAS_WORKSPACE_CONFIG" in text


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's shard of every parameter, by name."""
    return {name: local_tensor(p).detach().clone() for name, p in model.named_parameters()}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(bitwise equal, max abs difference) of two snapshots with the same names."""
    if a.keys() != b.keys():
        raise RuntimeError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return equal, diff


def save(model, optimizer, folder: Path) -> float:
    """DCP-save model and optimizer state into `folder`; returns seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    start = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    return time.perf_counter() - start


def load(model, optimizer, folder: Path) -> float:
    """DCP-load `folder` into model and optimizer (in place); returns seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    start = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return time.perf_counter() - start


def release(device: str) -> None:
    """Return freed memory to the device, so the next model fits."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def dcp_resume(scale: workload.Scale, mesh, folder: Path) -> dict:
    """Run A (step, save, step) against run B (fresh model, load, step); see the module docstring."""
    strict_error = None
    try:
        report = resume_runs(scale, mesh, folder / "strict", warn_only=False)
    except RuntimeError as exc:
        if "determinis" not in str(exc):
            raise
        strict_error = str(exc).splitlines()[0][:300]
    if strict_error is None:
        report["determinism"] = "strict"
    else:  # outside the except block, so the failed run's tensors are already freed
        release(scale.device)
        report = resume_runs(scale, mesh, folder / "warn_only", warn_only=True)
        report["determinism"] = f"warn_only (strict mode raised: {strict_error})"
    exact = report["next_params_equal"] or (
        report["determinism"] != "strict" and report["next_params_max_abs_diff"] <= WARN_ONLY_TOLERANCE
    )
    if not (report["loaded_state_equal"] and report["next_loss_equal"] and exact):
        report |= {"ok": False, "error": "the resumed step differs from the uninterrupted one"}
    return report


def resume_runs(scale: workload.Scale, mesh, folder: Path, *, warn_only: bool) -> dict:
    """Runs A and B under deterministic algorithms; the measurements, not yet judged."""
    config = workload.build_config(scale.dcp_overrides)
    batches = [
        workload.synthetic_batch(
            config, seq_len=scale.dcp_seq_len, image_side=scale.image_side, device=scale.device, seed=s
        )
        for s in (2, 3)
    ]
    caught: list[str] = []
    clock = PhaseClock(scale.device)
    with deterministic(caught, warn_only=warn_only):
        model, params, optimizer = sharded_model(config, mesh, device=scale.device, seed=0)
        train_step(model, optimizer, params, batches[0], clock)
        saved = snapshot(model)
        save_s = save(model, optimizer, folder)
        loss_a, _ = train_step(model, optimizer, params, batches[1], clock)
        after_a = snapshot(model)
        del model, params, optimizer
        release(scale.device)
        model, params, optimizer = sharded_model(config, mesh, device=scale.device, seed=1)
        load_s = load(model, optimizer, folder)
        loaded_equal, _ = compare(saved, snapshot(model))
        del saved
        loss_b, _ = train_step(model, optimizer, params, batches[1], clock)
        params_equal, params_diff = compare(after_a, snapshot(model))
    return {
        "model_params": sum(p.numel() for p in params),
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "checkpoint_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
        "loaded_state_equal": loaded_equal,
        "next_loss": [loss_a, loss_b],
        "next_loss_equal": loss_a == loss_b,
        "next_params_equal": params_equal,
        "next_params_max_abs_diff": params_diff,
        "nondeterminism_warnings": caught,
    }
