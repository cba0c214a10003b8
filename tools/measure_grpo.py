"""GRPO's closing-note numbers on the tiny CPU recipe, printed as JSON, all from one run of this script.

    .venv/bin/python tools/measure_grpo.py [--steps 12] [--repeats 5] [--planes local,driver] [--set section.key=value ...]

1. planes: recipes/tiny-grpo-cpu.yaml for `steps` steps with each data-plane setting (local,
   transfer_queue simple and mooncake, no plane: batches through the driver), one after the other
   through `vlmrun submit`; per setting the medians over steps 2.. of the step time, the data-plane
   time (rows' time_data_plane_s) and their ratio, and the bytes the plane moved per step.
2. bf16: the local setting again with model.dtype=bfloat16, whose plane casts pixel values to bf16
   before the wire: bytes per step with and without the cast, same steps, same samples.
3. generation: tokens/s of generation in the loop (rows' generation_tokens_per_s over dp: the loop
   runs its replicas side by side) against a bare transformers `generate` (its own sampling, no
   log-probs) on the same batch: replica 0's prompts of step 1 from its loader shard, each repeated
   num_generations times, the same weights, one thread; the recipe's generation backend in this process on that batch
   too. Medians over `repeats` interleaved rounds after one warm-up round.

`--set` goes to every run (e.g. model.tiny=false model.path=DIR for a trained start; a random tiny
model stops only at max_new_tokens). Each run's directory is kept under --work (default: a temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-grpo-cpu.yaml"
SETTINGS = {
    "local": ["data_plane.impl=local"],
    "transfer_queue_simple": ["data_plane.impl=transfer_queue", "data_plane.backend=simple"],
    "transfer_queue_mooncake": ["data_plane.impl=transfer_queue", "data_plane.backend=mooncake"],
    "driver": ["data_plane.enabled=false"],
}


def run(work: Path, name: str, steps: int, sets: list[str]) -> list[dict]:
    """The metrics rows of a `vlmrun submit` of the tiny GRPO recipe with `sets`."""
    args = [
        a
        for s in [f"train.max_steps={steps}", "train.val_samples=0", "logger.wandb_mode=disabled", *sets]
        for a in ("--set", s)
    ]
    cmd = [sys.executable, "-m", "vlmrun.cli", "submit", str(RECIPE), "--cluster", "local", "--run-dir"]
    out = subprocess.run([*cmd, str(work / name), *args, "--wait"], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{name}: vlmrun submit failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plane_row(rows: list[dict]) -> dict:
    steady = rows[1:]  # step 1 starts the loader workers and warms every cache

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    return {
        "step_time_s": round(median("step_time_s"), 4),
        "data_plane_s": round(median("time_data_plane_s"), 4),
        "data_plane_fraction": round(median("data_plane_fraction"), 4),
        "plane_bytes_per_step": int(median("plane_bytes")),
        "generation_tokens_per_s": round(median("generation_tokens_per_s"), 1),
        "losses": [r["loss"] for r in rows],
    }


def bare_generation(sets: list[str], work: Path, repeats: int) -> dict:
    """Replica 0's first prompts: bare `generate` vs `HfGenerator.generate`, same batch, one thread."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrun.algorithms.common.shards import open_train_shard
    from vlmrun.algorithms.common.steps import plan_steps
    from vlmrun.config.load import load_recipe
    from vlmrun.data.splits import split_size
    from vlmrun.distributed.topology import plan_placement
    from vlmrun.generation import open_generator
    from vlmrun.generation.interface import SamplingParams
    from vlmrun.generation.prompts import join_prompts, select_prompts
    from vlmrun.models.source import ensure_model
    from vlmrun.models.spec import ModelSpec

    torch.set_num_threads(1)
    recipe = load_recipe(RECIPE, sets)
    model_dir = str(ensure_model(recipe.model, work / "local" / "cache", recipe.train.seed))
    plan = plan_placement(recipe.parallel.layout)
    n_micro = plan_steps(recipe, split_size(recipe.data.path, recipe.data.split)).micro_batches_per_replica
    shard = open_train_shard(recipe, model_dir, shard=0, num_shards=plan.layout.dp, placement_hash=plan.placement_hash)
    try:
        spec = ModelSpec(directory=model_dir, dtype=recipe.model.dtype)
        ours = open_generator(recipe.generation.backend, model=spec, threads=1)
        info = ours.setup()
        prompts = join_prompts([shard.next_batch() for _ in range(n_micro)], ours.pad_token_id)
    finally:
        shard.close()
    g = recipe.grpo
    sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens, seed=0)
    bare = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = select_prompts(
        prompts, [i for i in range(len(prompts)) for _ in range(g.num_generations)], info["image_token_id"]
    )
    kwargs = dict(do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0, max_new_tokens=g.max_new_tokens)
    times: dict[str, list[float]] = {"bare": [], "hf_generator": []}
    tokens = {}
    for round_ in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = bare.generate(**rows.model_inputs(), pad_token_id=ours.pad_token_id, **kwargs)
        t_bare = time.perf_counter() - t0
        tokens["bare"] = out.shape[0] * (out.shape[1] - rows.input_ids.shape[1])
        rollouts = ours.generate(prompts, sampling, n=g.num_generations)
        tokens["hf_generator"] = rollouts.response_ids.numel()
        if round_:
            times["bare"].append(t_bare)
            times["hf_generator"].append(rollouts.generate_s)
    return {
        name: {"tokens": tokens[name], "tokens_per_s": round(tokens[name] / statistics.median(t), 1)}
        for name, t in times.items()
    }


def measure(work: Path, steps: int, repeats: int, sets: list[str], settings: list[str]) -> dict:
    planes = {name: plane_row(run(work, name, steps, [*sets, *SETTINGS[name]])) for name in settings}
    bf16 = plane_row(run(work, "local-bf16", steps, [*sets, *SETTINGS["local"], "model.dtype=bfloat16"]))
    generation = bare_generation(sets, work, repeats)
    from vlmrun.config.load import load_recipe

    in_loop_row = planes.get("local") or next(iter(planes.values()))
    in_loop = in_loop_row["generation_tokens_per_s"] / load_recipe(RECIPE, sets).parallel.dp
    return {
        "steps": steps,
        "sets": sets,
        "planes": {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in planes.items()},
        "identical_losses": len({json.dumps(v["losses"]) for v in planes.values()}) == 1,
        "plane_bytes_per_step": {
            "float32_pixels": planes["local"]["plane_bytes_per_step"] if "local" in planes else None,
            "bfloat16_pixels": bf16["plane_bytes_per_step"],
        },
        "generation": {
            "in_loop_tokens_per_s_per_replica": round(in_loop, 1),
            **generation,
            "in_loop_over_bare": round(in_loop / generation["bare"]["tokens_per_s"], 3),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: temp)")
    parser.add_argument("--planes", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}")
    args = parser.parse_args()
    settings = [p for p in args.planes.split(",") if p]
    if not settings or set(settings) - set(SETTINGS):
        parser.error(f"--planes: {args.planes!r}; allowed: a comma-separated subset of {','.join(SETTINGS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="vlmrun-measure-grpo-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(json.dumps(measure(work, args.steps, args.repeats, args.sets, settings), indent=2))


if __name__ == "__main__":
    main()
