"""A GRPO step with each prompt's images through the vision tower once per stage (the product's way,
models/shared_images.py) against once per response (before), side by side in interleaved rounds, as JSON.

    .venv/bin/python tools/bench_vision.py [--recipe recipes/tiny-grpo-cpu.yaml] [--family F] [--rounds 5]
                                           [--prompts N] [--tower tiny|3b-width] [--set grpo.num_generations=4 ...]
                                           [--json]

One replica's step of the recipe on one rank, in this process, with the product's parts: the `hf`
generator samples `grpo.num_generations` responses to each of `--prompts` CLEVR prompts (default: a
replica's share of `train.global_batch_size`) at the recipe's image size; the rollout is laid out as
the planes give it (`rollout_columns`, `join`); the logprob stage runs `HfPolicy.logprobs` over
`model_batches` of `train.micro_batch_size` prompts' responses; the train stage runs
`HfPolicy.train_step` with GRPO's clipped loss over `pg_micro_batches`. The learning rate is 0 and the
sampling stream is restored before each step, so every step of either way sees the same responses.

`--tower 3b-width` (qwen2_5_vl): the tiny model with Qwen2.5-VL-3B's vision tower at its own width
(hidden 1280, MLP 3420, 16 heads; 2 blocks deep instead of 32), random init, so that a patch row costs
what it costs there: the tiny tower (32 wide) spends most of a call on work per call and per image
that does not shrink with the rows it is given.

Per way and stage: wall time, the vision tower's forward time and the patch rows it was given; for the
train stage also the tower's backward (from its output's gradient to its last parameter's). Ratios are
shared / repeated per round, with their spread. Goal (issue 21): vision time divided by about G.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from measure_generation import prompt_batch
from measure_memory import rank_policy

from vlmrun.observe.ratios import ratio_spread, round_ratios

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-grpo-cpu.yaml"
#: Qwen2.5-VL-3B's vision tower width (its config.json), for `--tower 3b-width`
TOWERS = {"tiny": {}, "3b-width": {"hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}}
STAGES = ("generate", "logprob", "train")
WAYS = ("shared", "repeated")


class TowerClock:
    """Times the vision tower of `model`: forward wall time and patch rows per call, and each backward's
    time from the gradient reaching the tower's output to the last of its parameters' gradients."""

    def __init__(self, model: torch.nn.Module):
        self.tower = next(m for name, m in model.named_modules() if name.endswith(("visual", "vision_model")))
        self.forward_s = self.backward_s = 0.0
        self.rows = 0
        self._t0 = 0.0
        self._grad_at: float | None = None
        self._last_param = 0.0
        self.tower.register_forward_pre_hook(self._before)
        self.tower.register_forward_hook(self._after)
        for p in self.tower.parameters():
            p.register_post_accumulate_grad_hook(self._param_done)

    def reset(self) -> None:
        self.settle()
        self.forward_s = self.backward_s = 0.0
        self.rows = 0

    def settle(self) -> None:
        """Count the backward that ran since the last forward (the next forward, or the caller, calls it)."""
        if self._grad_at is not None:
            self.backward_s += self._last_param - self._grad_at
        self._grad_at = None

    def _before(self, _module, args):
        self.settle()
        self.rows += int(args[0].shape[0])
        self._t0 = time.perf_counter()

    def _after(self, _module, _args, out):
        self.forward_s += time.perf_counter() - self._t0
        values = out.values() if hasattr(out, "values") else [out]
        for v in values:
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(self._grad_arrived)

    def _grad_arrived(self, grad):
        if self._grad_at is None:
            self._grad_at = time.perf_counter()
        return grad

    def _param_done(self, _param):
        self._last_param = time.perf_counter()


def with_tower(model_dir: Path, tower: dict, out: Path) -> Path:
    """The model of `model_dir` with its vision config updated by `tower`, random init (seed 0), saved at
    `out` with `model_dir`'s tokenizer and processor."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    values = json.loads((model_dir / "config.json").read_text())
    values["vision_config"] |= tower
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    for f in model_dir.iterdir():
        if f.is_file() and not (out / f.name).exists() and f.suffix != ".safetensors" and f.name != "vlmrun_tiny.json":
            shutil.copy(f, out / f.name)
    return out


def measure(recipe, family: str, rounds: int, prompts: int, work: Path, tower: str = "tiny") -> dict:
    from vlmrun.algorithms.grpo.loss import ClippedPgLoss
    from vlmrun.algorithms.grpo.micro_batches import batch_response_values, model_batches, pg_micro_batches
    from vlmrun.algorithms.grpo.rollout_rows import join, rollout_columns
    from vlmrun.config.dtype import torch_dtype
    from vlmrun.generation import open_generator
    from vlmrun.generation.interface import SamplingParams
    from vlmrun.models.fit import training_shape
    from vlmrun.models.source import ensure_model
    from vlmrun.models.spec import ModelSpec
    from vlmrun.plane.interface import SampleBatch
    from vlmrun.rewards.builtin import Scored

    train = recipe.train.model_copy(update={"lr": 0.0})
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"family": family}), "train": train})
    g = recipe.grpo
    shape, _ = training_shape(recipe)
    model_dir = str(ensure_model(recipe.model, work / "models", seed=0))
    if TOWERS[tower]:
        model_dir = str(with_tower(Path(model_dir), TOWERS[tower], work / "model"))
    spec = ModelSpec(directory=model_dir, dtype=recipe.model.dtype)
    batch = prompt_batch(family, Path(model_dir), work, prompts, image_size=shape.image_size)
    generator = open_generator("hf", model=spec)
    generator.setup()
    policy = rank_policy(recipe, model_dir, max_steps=1 + 2 * rounds)
    sampling = SamplingParams(
        temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens, seed=recipe.train.seed
    )
    generator.generate(batch, sampling, n=1)  # starts the sampling stream
    stream = generator.state_dict()
    clocks = {"generate": TowerClock(generator.model), "policy": TowerClock(policy.model)}
    rows = recipe.train.micro_batch_size * g.num_generations
    layout = {"family": family, "pad_token_id": generator.pad_token_id, "pixel_dtype": torch_dtype(recipe.model.dtype)}
    loss = ClippedPgLoss(g)

    def step(share: bool) -> dict:
        out: dict = {}
        generator.load_state_dict(stream)
        generator.share_images = share
        clock = clocks["generate"]
        clock.reset()
        t0 = time.perf_counter()
        rollouts = generator.generate(batch, sampling, n=g.num_generations)
        out["generate"] = _stage(time.perf_counter() - t0, clock)
        scored = [Scored(reward=float(i % 2), correct=False, well_formed=True) for i in range(len(rollouts))]
        written = rollout_columns(rollouts, scored, family=family, image_token_id=generator.image_token_id)
        got = join(written.prompts, written.responses)
        clock = clocks["policy"]
        clock.reset()
        t0 = time.perf_counter()
        prev, start = [], 0
        for b in model_batches(got, rows, **layout, share_images=share):
            prev += batch_response_values(policy.logprobs(b), b, got, start)
            start += len(b)
        out["logprob"] = _stage(time.perf_counter() - t0, clock)
        columns = {**got.columns, "prev_logprobs": prev, "generation_logprobs": prev}
        columns["advantages"] = [torch.tensor(float(i % 2) * 2 - 1) for i in range(len(got))]
        got = SampleBatch(sample_ids=list(got.sample_ids), columns=columns)
        clock.reset()
        t0 = time.perf_counter()
        policy.train_step(pg_micro_batches(got, rows, **layout, share_images=share), loss)
        clock.settle()
        out["train"] = _stage(time.perf_counter() - t0, clock) | {"vision_backward_s": clock.backward_s}
        out["step_s"] = sum(out[s]["s"] for s in STAGES)
        out["vision_s"] = sum(out[s]["vision_forward_s"] for s in STAGES) + out["train"]["vision_backward_s"]
        return out

    try:
        for share in (True, False):  # warm-up: first-call allocations
            step(share)
        runs = {w: [] for w in WAYS}
        for r in range(rounds):
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            for way in order:
                runs[way].append(step(way == "shared"))
    finally:
        policy.shutdown()

    def med(way: str, *path: str) -> float:
        return round(statistics.median(_at(run, path) for run in runs[way]), 4)

    def ratio(*path: str) -> dict:
        return ratio_spread(
            round_ratios([_at(r, path) for r in runs["shared"]], [_at(r, path) for r in runs["repeated"]])
        )

    return {
        "family": family,
        "tower": {"name": tower, **json.loads((Path(model_dir) / "config.json").read_text())["vision_config"]},
        "prompts": prompts,
        "num_generations": g.num_generations,
        "rows_per_micro_batch": rows,
        "image_size": shape.image_size,
        "stages": {
            way: {s: {k: med(way, s, k) for k in runs[way][0][s]} for s in STAGES}
            | {"step_s": med(way, "step_s"), "vision_s": med(way, "vision_s")}
            for way in WAYS
        },
        "step_shared_over_repeated": ratio("step_s"),
        "vision_shared_over_repeated": ratio("vision_s"),
        "vision_rows_shared_over_repeated": {
            s: runs["shared"][0][s]["vision_rows"] / max(runs["repeated"][0][s]["vision_rows"], 1) for s in STAGES
        },
    }


def _stage(seconds: float, clock: TowerClock) -> dict:
    return {"s": seconds, "vision_forward_s": clock.forward_s, "vision_rows": clock.rows}


def _at(run: dict, path: tuple[str, ...]) -> float:
    for key in path:
        run = run[key]
    return float(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--family", default="qwen2_5_vl", help="a family of vlmrun/config/families.py")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: a replica's share)")
    parser.add_argument(
        "--tower", choices=sorted(TOWERS), default="tiny", help="the family's tiny tower, or 3b-width (qwen2_5_vl)"
    )
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. grpo.num_generations=4")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default output too)")
    args = parser.parse_args()
    from vlmrun.config.load import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    if recipe.train.algorithm != "grpo":
        sys.exit(f"--recipe {args.recipe}: train.algorithm is {recipe.train.algorithm!r}; this compares GRPO steps")
    if args.tower != "tiny" and args.family != "qwen2_5_vl":
        sys.exit(f"--tower {args.tower}: Qwen2.5-VL-3B's tower; --family {args.family} has its own vision config keys")
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: at least 1")
    prompts = args.prompts or recipe.train.global_batch_size // recipe.parallel.dp
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-vision-") as tmp:
        print(json.dumps(measure(recipe, args.family, args.rounds, prompts, Path(tmp), tower=args.tower)))


if __name__ == "__main__":
    main()
