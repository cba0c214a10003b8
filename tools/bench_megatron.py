"""Training throughput of the megatron backend at tp=2 against the hf backend at dp=2: the same model, the
same micro-batches, the same 2 CPU ranks each, in interleaved rounds, as JSON.

    .venv/bin/python tools/bench_megatron.py --size tiny --rounds 6 --steps 2 --json

Four processes: two ranks of the hf policy (replicated, dp=2: each rank half of the step's
micro-batches) and two of the megatron policy (tp=2, one replica: both ranks every micro-batch), each
pair its own gloo group. Rounds alternate (hf, then megatron, each `--steps` optimizer steps, the other
pair waiting at a barrier), so a neighbour's load lands on both sides alike; a side's tokens/s in a
round is the step's valid tokens over its slowest rank's step seconds. Reported: each side's median
over the rounds, and the per-round ratio megatron / hf as its median with the spread
(vlmrun/observe/ratios.py). The micro-batches are CLEVR conversations (a generated set, 112 px
images) encoded for the model; `tiny` is the tiny Qwen2.5-VL (0.65M parameters), `mid` the Qwen2.5-VL
layout narrowed to ~0.27B parameters (random init from the same seed on both sides). The first step's
loss of both sides is reported too (they agree to ~1e-6: tests/test_megatron_policy.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SIDES = ("hf", "megatron")
#: How long a side waits for the other's turn: a side that died breaks the rounds instead of hanging them.
BARRIER_S = 3600
#: The Qwen2.5-VL-3B layout narrowed to ~0.27B parameters (tools/bench_refit.py's `mid`, its mRoPE
#: sections scaled to the narrower heads so that it runs a forward).
MID_OVERRIDES = {
    "text_config": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        # head_dim 64: 32 rotary frequencies over (time, height, width), as the 3B's 64 are
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]},
    },
    "vision_config": {"depth": 2, "fullatt_block_indexes": [1], "out_hidden_size": 1024},
}


def _spec(size: str, model_dir: str):
    from vlmrun.models.spec import ModelSpec

    if size == "tiny":
        return ModelSpec(directory=model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    reference = json.loads(
        (Path(__file__).resolve().parents[1] / "vlmrun/models/reference/qwen2_5_vl_3b.json").read_text()
    )
    for part, values in MID_OVERRIDES.items():
        reference[part] = {**reference[part], **values}
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):  # the tiny tokenizer's ids
        reference["text_config"][key] = config["text_config"].get(key)
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        reference[key] = config[key]
    return ModelSpec(config=reference, seed=1)


def _rank(index: int, args, model_dir: str, batches: list, ports: dict, barrier, out: str) -> None:
    from types import SimpleNamespace

    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    side, rank = SIDES[index // 2], index % 2
    parallel = SimpleNamespace(dp=2, tp=1, pp=1, fsdp=False) if side == "hf" else SimpleNamespace(dp=1, tp=2, pp=1)
    train = SimpleNamespace(
        seed=0, optimizer="adamw", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0,
        lr_schedule="constant", min_lr_ratio=0.0, grad_clip=1.0,
    )  # fmt: skip
    policy = open_policy(
        side, model=_spec(args.size, model_dir), rank=rank, world_size=2, train=train, parallel=parallel
    )
    policy.setup(master_addr="127.0.0.1", master_port=ports[side], max_steps=10_000)
    mine = batches[rank::2] if side == "hf" else batches
    steps: list[dict] = []
    barrier.wait(timeout=BARRIER_S)  # every side built: the rounds begin
    for _ in range(args.rounds):
        for turn in SIDES:
            if turn == side:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    result = policy.train_step(mine)
                    steps.append({"s": time.perf_counter() - t0, "tokens": result.valid_tokens, "loss": result.loss})
            barrier.wait(timeout=BARRIER_S)
    Path(f"{out}.{index}").write_text(json.dumps(steps))
    policy.shutdown()
    os._exit(0)  # gloo's threads sometimes abort in C++ destructors at interpreter exit


def _batches(model_dir: str, data: Path, micro: int, size: int) -> list:
    """`micro` micro-batches of `size` CLEVR conversations of the set at `data`, encoded for the model."""
    from vlmrun.config.load import validate
    from vlmrun.data.loader import val_batches

    raw = {
        "name": "bench",
        "model": {"family": "qwen2_5_vl", "tiny": True},
        "data": {"path": str(data), "num_workers": 0, "shuffle_buffer": 16, "max_seq_len": 256},
        "train": {"micro_batch_size": size, "global_batch_size": size},
    }
    loss, _, _ = val_batches(validate(raw), processor_dir=model_dir, samples=micro * size, batch_size=size)
    return loss[:micro]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "mid"), default="tiny")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per side per round")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (each side)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from vlmrun.datasets.clevr import ensure_clevr
    from vlmrun.models.tiny import ensure_tiny_model
    from vlmrun.observe.ratios import ratio_spread, round_ratios

    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-megatron-") as tmp:
        model_dir = str(ensure_tiny_model("qwen2_5_vl", Path(tmp) / "models", seed=0))
        data = Path(tmp) / "clevr"
        ensure_clevr(data, train=16, val=32, image_size=112, seed=0)
        batches = _batches(model_dir, data, args.micro_batches, args.micro_batch_size)
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(4)
        ports = {side: _free_port() for side in SIDES}
        out = str(Path(tmp) / "steps")
        procs = [
            context.Process(target=_rank, args=(i, args, model_dir, batches, ports, barrier, out)) for i in range(4)
        ]
        for p in procs:
            p.start()
        _join(procs)
        steps = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(4)]
    report = _report(args, steps, ratio_spread, round_ratios)
    print(json.dumps(report, indent=None if args.json else 2))
    return report


def _report(args, steps: list[list[dict]], ratio_spread, round_ratios) -> dict:
    """Per side, per round: tokens / the slowest rank's seconds, summed over the round's steps."""
    per_round = {}
    for s, side in enumerate(SIDES):
        a, b = steps[2 * s], steps[2 * s + 1]
        rounds = []
        for r in range(args.rounds):
            window = slice(r * args.steps, (r + 1) * args.steps)
            seconds = sum(max(x["s"], y["s"]) for x, y in zip(a[window], b[window], strict=True))
            rounds.append(sum(x["tokens"] for x in a[window]) / seconds)
        per_round[side] = rounds
    ratios = round_ratios(per_round["megatron"], per_round["hf"])
    return {
        "size": args.size,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "micro_batches": args.micro_batches,
        "tokens_per_step": steps[0][0]["tokens"],
        "hf_dp2": {
            "tokens_per_s_median": round(statistics.median(per_round["hf"]), 1),
            "first_loss": steps[0][0]["loss"],
        },
        "megatron_tp2": {
            "tokens_per_s_median": round(statistics.median(per_round["megatron"]), 1),
            "first_loss": steps[2][0]["loss"],
        },
        "megatron_over_hf_rounds": ratio_spread(ratios),
        "megatron_over_hf": ratio_spread(ratios)["median"],
    }


def _join(procs: list) -> None:
    """Wait for every rank; once one failed, end the others (they would wait for it) and exit 1."""
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
            break
        time.sleep(0.5)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main(sys.argv[1:])
