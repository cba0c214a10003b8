"""DCP resume through vlmrun's checkpoint store: a policy takes a step, the store saves its sharded state,
the policy takes the next step; a fresh policy built from another seed loads that checkpoint and takes
the same next step: the losses and parameters must be bitwise equal.

The save and load are the product's: `CheckpointStore.begin`, `PendingCheckpoint.write_policy` of the
policy's `checkpoint_state()` (every rank its DCP shard, hashed), `finish` (manifest, fsync, rename);
`CheckpointStore.at` (verifies every file's size and checksum), `Checkpoint.read_policy` and the policy's
`load_checkpoint_state`.

1. The section runs under `torch.use_deterministic_algorithms(True)` (flash attention's backward
   otherwise accumulates dQ in any order; cuBLAS needs CUBLAS_WORKSPACE_CONFIG, which check.py sets
   before CUDA starts). Where an op has no deterministic kernel and raises, the section runs again with
   `warn_only=True`, says so in `determinism` (with the op), and then accepts parameters within
   WARN_ONLY_TOLERANCE: kernel noise moves a 0.02-sized fp32 weight by a few ulps (~1e-8), an optimizer
   state that did not load moves it by about the learning rate (1e-5).
2. `loaded_state_equal` (the weights right after load against those saved) tells a load that went
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

from vlmrun.checkpoint.parts import MODEL_PART
from vlmrun.checkpoint.store import CheckpointStore

WARN_ONLY_TOLERANCE = 1e-7
STEP = 1


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


def snapshot(policy) -> dict[str, torch.Tensor]:
    """A copy of this rank's shard of every tensor of the policy's model part, by name."""
    weights = policy.checkpoint_state().parts[MODEL_PART]
    return {name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for name, t in weights.items()}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(bitwise equal, max abs difference) of two snapshots with the same names."""
    if a.keys() != b.keys():
        raise RuntimeError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return equal, diff


def save(policy, store: CheckpointStore) -> float:
    """The policy's state as checkpoint STEP of `store`, as a training run saves it; returns seconds."""
    start = time.perf_counter()
    pending = store.begin(STEP)
    files = pending.write_policy(policy.checkpoint_state(), rank=0)
    files |= pending.write("controller", {"counters": {"step": STEP}})
    store.finish(pending, files, None)
    return time.perf_counter() - start


def load(policy, store: CheckpointStore) -> tuple[float, float]:
    """Checkpoint STEP of `store` into the policy, as a resumed run loads it (the newest that verifies);
    (verify s, load s)."""
    start = time.perf_counter()
    checkpoint, _ = store.latest()
    if checkpoint is None or checkpoint.step != STEP:
        raise RuntimeError(f"checkpoint step {STEP} did not verify")
    verified = time.perf_counter()
    policy.load_checkpoint_state(checkpoint.read_policy(policy.checkpoint_state()))
    return verified - start, time.perf_counter() - verified


def release(device: str) -> None:
    """Return freed memory to the device, so the next model fits (FSDP's hooks hold a dropped model in
    reference cycles until a collection)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def dcp_resume(scale: workload.Scale, folder: Path) -> dict:
    """Run A (step, save, step) against run B (fresh policy, load, step); see the module docstring."""
    strict_error = None
    try:
        report = resume_runs(scale, folder / "strict", warn_only=False)
    except RuntimeError as exc:
        if "determinis" not in str(exc):
            raise
        strict_error = str(exc).splitlines()[0][:300]
    if strict_error is None:
        report["determinism"] = "strict"
    else:  # outside the except block, so the failed run's tensors are already freed
        release(scale.device)
        report = resume_runs(scale, folder / "warn_only", warn_only=True)
        report["determinism"] = f"warn_only (strict mode raised: {strict_error})"
    exact = report["next_params_equal"] or (
        report["determinism"] != "strict" and report["next_params_max_abs_diff"] <= WARN_ONLY_TOLERANCE
    )
    if not (report["loaded_state_equal"] and report["next_loss_equal"] and exact):
        report |= {"ok": False, "error": "the resumed step differs from the uninterrupted one"}
    return report


def resume_runs(scale: workload.Scale, folder: Path, *, warn_only: bool) -> dict:
    """Runs A and B under deterministic algorithms; the measurements, not yet judged."""
    config = workload.model_config(scale.dcp_overrides)
    batches = [
        workload.synthetic_batch(config, seq_len=scale.dcp_seq_len, image_side=scale.image_side, seed=s) for s in (2, 3)
    ]
    store = CheckpointStore(folder, keep=1)
    caught: list[str] = []
    with deterministic(caught, warn_only=warn_only):
        policy = workload.open_check_policy(config, scale, seed=0)
        try:
            policy.train_step([batches[0]])
            saved = snapshot(policy)
            save_s = save(policy, store)
            next_a = policy.train_step([batches[1]])
            after_a = snapshot(policy)
        finally:
            policy.shutdown()
        del policy
        release(scale.device)
        policy = workload.open_check_policy(config, scale, seed=1)
        try:
            verify_s, load_s = load(policy, store)
            loaded_equal, _ = compare(saved, snapshot(policy))
            del saved
            next_b = policy.train_step([batches[1]])
            params_equal, params_diff = compare(after_a, snapshot(policy))
        finally:
            policy.shutdown()
    files = [f for f in store.complete()[-1][1].rglob("*") if f.is_file()]
    return {
        "model_state_numel": sum(t.numel() for t in after_a.values()),
        "save_s": round(save_s, 3),
        "verify_s": round(verify_s, 3),
        "load_s": round(load_s, 3),
        "checkpoint_files": len(files),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "loaded_state_equal": loaded_equal,
        "next_loss": [next_a.loss, next_b.loss],
        "next_loss_equal": next_a.loss == next_b.loss,
        "next_grad_norm_equal": next_a.grad_norm == next_b.grad_norm,
        "next_params_equal": params_equal,
        "next_params_max_abs_diff": params_diff,
        "nondeterminism_warnings": caught,
    }
