"""The `hf` policy itself on one device, without Ray or a recipe: the code path a GPU rank runs.

    PYTHONPATH=. python3 tools/gpu/policy_check.py --model-dir DIR [--out FILE]

DIR is a Hugging Face model directory (build the tiny one here with
`vlmrun.models.tiny.ensure_tiny_model("qwen2_5_vl", CACHE)` and carry it). One rank, FSDP2, bf16
mixed precision over fp32 master weights, activation checkpointing, on `cuda:0` when torch sees a GPU
(NCCL for GPU tensors, gloo for the CPU scalars) else on the CPU: three training steps, a sharded
checkpoint through the checkpoint store, a fresh policy that loads it and takes the same next step
bit for bit, and validation (the policy's logprobs, and greedy answers from a generation engine refit
from the policy). Policy and engine come from the product's factories. Writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from vlmrun.algorithms.common.validation import ValidationShare, evaluate
from vlmrun.checkpoint.store import CheckpointStore
from vlmrun.data.batch import Batch, PromptBatch
from vlmrun.generation import open_generator
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy
from vlmrun.policy.interface import PolicyBackend

TRAIN = SimpleNamespace(
    seed=1234,
    lr=1e-3,
    betas=(0.9, 0.95),
    weight_decay=0.0,
    optimizer="adamw",
    warmup_steps=0,
    lr_schedule="constant",
    min_lr_ratio=1.0,
    grad_clip=1.0,
)
PARALLEL = SimpleNamespace(
    fsdp=True, mixed_precision="bf16", activation_checkpointing=True, cpu_offload=False, reduce_every_micro_batch=False
)
TEXTS = ["how many red cubes? answer: 3", "how many spheres are there? answer: 2", "what color is it? answer: blue"]


def policy(model_dir: str, port: int) -> PolicyBackend:
    p = open_policy(
        "hf",
        model=ModelSpec(directory=model_dir),
        rank=0,
        world_size=1,
        train=TRAIN,
        parallel=PARALLEL,
        gpus=torch.cuda.is_available(),
    )
    p.setup(master_addr="127.0.0.1", master_port=port, max_steps=10)
    return p


def batches(tokenizer) -> list[Batch]:
    out = []
    for i, text in enumerate(TEXTS[:2]):
        ids = torch.tensor([tokenizer.encode(text)])
        out.append(Batch([f"s{i}"], ids, torch.ones_like(ids), ids.clone()))
    return out


def prompts(tokenizer) -> list[PromptBatch]:
    ids = torch.tensor([tokenizer.encode("how many cubes? answer:")])
    return [PromptBatch(["p0"], ids, torch.ones_like(ids), answers=["3"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def validate(first: PolicyBackend, model_dir: str, tokenizer, micro: list[Batch]):
    """The product's validation: NLL from the policy's logprobs, greedy answers from a refit engine."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = open_generator("hf", model=ModelSpec(directory=model_dir, dtype="bfloat16"), device=device)
    engine.setup()

    def decode(rollouts) -> list[str]:
        ids = rollouts.response_ids.masked_fill(rollouts.response_mask == 0, rollouts.pad_token_id)
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    try:
        return evaluate(ValidationShare(micro, prompts(tokenizer)), policy=first, generator=engine, decode=decode)
    finally:
        engine.shutdown()


def run(model_dir: str, folder: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = policy(model_dir, free_port())
    micro = batches(tokenizer)
    steps = [first.train_step(micro) for _ in range(3)]
    device = str(next(first.model.parameters()).device)
    store = CheckpointStore(folder, keep=1)
    pending = store.begin(3)
    files = pending.write_policy(first.checkpoint_state(), rank=0)
    files |= pending.write("controller", {"counters": {}})
    store.finish(pending, files, None)
    t0 = time.perf_counter()
    val = validate(first, model_dir, tokenizer, micro)
    score_s = time.perf_counter() - t0
    next_a = first.train_step(micro)
    first.shutdown()
    second = policy(model_dir, free_port())
    with store.reading(3) as (saved, _):
        second.load_checkpoint_state(saved.read_policy(second.checkpoint_state()))
    next_b = second.train_step(micro)
    second.shutdown()
    return {
        "device": device,
        "losses": [s.loss for s in steps],
        "grad_norms": [s.grad_norm for s in steps],
        "loss_falls": steps[-1].loss < steps[0].loss,
        "checkpoint_files": sorted(files),
        "validation": {"nll": val.nll, "tokens": val.tokens, "answered": val.answered, "seconds": round(score_s, 3)},
        "next_step_after_load": [next_a.loss, next_b.loss],
        "next_step_equal": next_a.loss == next_b.loss and next_a.grad_norm == next_b.grad_norm,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="a Hugging Face model directory (tiny is enough)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrun-policy-check-") as tmp:
        try:
            report = {"ok": True, **run(args.model_dir, Path(tmp))}
            report["ok"] = report["loss_falls"] and report["next_step_equal"]
        except Exception as e:  # noqa: BLE001 - one JSON either way: the report says what broke
            report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            import traceback

            report["traceback"] = traceback.format_exc()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
