"""An SFT step over sequences packed into rows of a token budget (data/packing.py) against the same
sequences in padded rows of `train.micro_batch_size` (the loader's micro-batches), side by side in
interleaved rounds, as JSON.

    .venv/bin/python tools/bench_packing.py [--recipe recipes/tiny-clevr-cpu.yaml] [--family F]
                                            [--pack-tokens 512] [--step-samples N] [--rounds 5] [--json]

One rank's step of the recipe in this process: `--step-samples` CLEVR conversations (default: a
rank's share of `train.global_batch_size`, times 4) at the recipe's image size, encoded by the
recipe's own encoder, trained with the `hf` policy's `train_step` either way: padded, micro-batches
of `train.micro_batch_size` rows padded to their longest (today's layout); packed, each
micro-batch one row of at most `--pack-tokens` tokens, filled in order. The learning rate is 0, so
every step starts from the same weights and the two losses must agree (`loss_rel_diff`).

Per way: the step's wall time, tokens/s (real tokens, padding not counted), the padding fraction of
the token slots, and the micro-batches; ratios are packed / padded per round with their spread.
Goal (issue 21): padding under 10% packed. A Qwen-VL family only (Nemotron is not packed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from measure_memory import rank_policy

from vlmrun.observe.ratios import ratio_spread, round_ratios

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-clevr-cpu.yaml"
WAYS = ("packed", "padded")


def measure(recipe, family: str, rounds: int, pack_tokens: int, step_samples: int, work: Path) -> dict:
    from vlmrun.config.families import family_spec
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import cook_conversation
    from vlmrun.data.loader import load_processor
    from vlmrun.data.packing import by_tokens, pack, padding_fraction, rows_for
    from vlmrun.datasets.clevr import generate_clevr, read_complete
    from vlmrun.models.fit import training_shape
    from vlmrun.models.source import ensure_model

    train = recipe.train.model_copy(update={"lr": 0.0})
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"family": family}), "train": train})
    shape, _ = training_shape(recipe)
    data = work / f"clevr-{shape.image_size}"
    if read_complete(data) is None:
        generate_clevr(data, train=step_samples, val=8, image_size=shape.image_size, seed=0)
    model_dir = str(ensure_model(recipe.model, work / "models", seed=0))
    spec = family_spec(family)
    encoder = ConversationEncoder(load_processor(model_dir, family), spec, max_seq_len=recipe.data.max_seq_len)
    raw = _crude_samples(data, "train")
    samples = [encoder.encode(cook_conversation(raw[k])) for k in sorted(raw)[:step_samples]]
    rows = recipe.train.micro_batch_size
    padded = [encoder.collate(samples[i : i + rows]) for i in range(0, len(samples), rows)]
    # what an SFT rank with data.pack_by: tokens trains (algorithms/sft/worker.py): the loader's micro-batches,
    # packed by samples, laid out again as rows of the budget (data/packing.by_tokens)
    loaded = [
        pack(samples[i : i + rows], row_tokens=recipe.data.max_seq_len, pad_token_id=encoder.pad_token_id, family=spec)
        for i in range(0, len(samples), rows)
    ]
    count = rows_for(loaded, pack_tokens)  # one rank: the rows it fills
    packed = by_tokens(loaded, row_tokens=pack_tokens, count=count, pad_token_id=encoder.pad_token_id, family=spec)
    policy = rank_policy(recipe, model_dir, max_steps=2 + 2 * rounds)
    ways = {"packed": packed, "padded": padded}
    try:
        for micro in ways.values():  # warm-up
            policy.train_step(micro)
        runs: dict[str, list] = {w: [] for w in WAYS}
        for r in range(rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                t0 = time.perf_counter()
                result = policy.train_step(ways[way])
                runs[way].append((time.perf_counter() - t0, result.loss))
    finally:
        policy.shutdown()
    tokens = sum(s.input_ids.numel() for s in samples)

    def row(way: str) -> dict:
        slots = sum(b.input_ids.numel() for b in ways[way])
        seconds = statistics.median(t for t, _ in runs[way])
        return {
            "micro_batches": len(ways[way]),
            "tokens_per_micro_batch": round(tokens / len(ways[way]), 1),
            "step_s": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1),
            "padding_fraction": round(1 - tokens / slots, 4),
            "padding_fraction_mean_micro_batch": round(statistics.mean(padding_fraction(b) for b in ways[way]), 4),
            "loss": runs[way][0][1],
        }

    out = {"family": family, "samples": len(samples), "tokens": tokens, "pack_tokens": pack_tokens}
    out |= {way: row(way) for way in WAYS}
    out["loss_rel_diff"] = abs(out["packed"]["loss"] - out["padded"]["loss"]) / abs(out["padded"]["loss"])
    out["tokens_per_s_packed_over_padded"] = ratio_spread(
        round_ratios([1 / t for t, _ in runs["packed"]], [1 / t for t, _ in runs["padded"]])
    )
    return out


def _crude_samples(folder: Path, split: str) -> dict[str, dict]:
    """key -> the sample's files by extension, as Energon hands a sample to the cooker."""
    import tarfile

    samples: dict[str, dict] = {}
    for shard in sorted(folder.glob(f"{split}-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {"__key__": key, "__restore_key__": ()})[ext] = tar.extractfile(member).read()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--family", default="qwen2_5_vl", help="a Qwen-VL family of vlmrun/config/families.py")
    parser.add_argument("--pack-tokens", type=int, default=512, help="tokens per packed row (default 512)")
    parser.add_argument("--step-samples", type=int, default=None, help="conversations per step")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. data.max_seq_len=1024")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default output too)")
    args = parser.parse_args()
    from vlmrun.config.load import load_recipe
    from vlmrun.models.packing import packing_refusal

    recipe = load_recipe(args.recipe, args.set)
    if (why := packing_refusal(args.family)) is not None:
        sys.exit(f"--family {args.family}: not packed: {why}")
    if args.rounds < 1 or args.pack_tokens < 1:
        sys.exit("--rounds and --pack-tokens: at least 1")
    step = args.step_samples or 4 * recipe.train.global_batch_size // recipe.parallel.dp
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-packing-") as tmp:
        print(json.dumps(measure(recipe, args.family, args.rounds, args.pack_tokens, step, Path(tmp))))


if __name__ == "__main__":
    main()
