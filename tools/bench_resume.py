"""A resume's start against a cold start, through the product (`vlmrun submit` / `vlmrun resume`), as JSON.

    .venv/bin/python tools/bench_resume.py --size mid --rounds 3 --json

The model is the tiny Qwen2.5-VL's (its tokenizer, processor and token ids) grown to `--size` (`mid`:
~0.27B parameters in 24 decoder layers of width 1024; `tiny`: as built, for the tests), random-init, saved
once as bf16 safetensors, as published checkpoints are; the recipe is the tiny SFT recipe on it
(`model.path`), FSDP2 over `--ranks` gloo ranks, on a small CLEVR set (generated first, so that no
attempt's start includes it). In interleaved rounds: a cold start (a fresh run directory: the sharded
load of the model's files; it trains one step and seals its checkpoint, fp32 model and AdamW state) and
a resume (a copy of the first cold start's run, `vlmrun resume --set train.max_steps=2`: the checkpoint
verified, then read into the ranks); the first round starts cold. Each side's number is the attempt's own `first_step_s` in job.json: from the
attempt's start (the node process) to its first step's end, as the job reports it to users. The ratio is
the median of the per-round ratios with their spread (vlmrun/observe/ratios.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vlmrun.datasets.clevr import ensure_clevr
from vlmrun.observe.ratios import ratio_spread, round_ratios

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
DATA = {"train": 64, "val": 8, "image_size": 112, "seed": 0}
#: text_config overrides of the tiny model per --size (mrope_section sums to half the head dim, 64)
SIZES = {
    "tiny": {},
    "mid": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "layer_types": ["full_attention"] * 24,
        "max_window_layers": 24,
        "rope_parameters": {"mrope_section": [8, 12, 12], "rope_theta": 1000000.0, "rope_type": "default"},
    },
}


def save_model(size: str, work: Path) -> tuple[Path, int]:
    """The model of `size` saved under work/model with the tiny model's tokenizer and processor; (its
    directory, its parameter count)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrun.models.tiny import ensure_tiny_model

    tiny = Path(ensure_tiny_model("qwen2_5_vl", work / "tiny", seed=0))
    values = json.loads((tiny / "config.json").read_text())
    values["text_config"] |= SIZES[size]
    values["vision_config"]["out_hidden_size"] = values["text_config"]["hidden_size"]
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    out = work / "model"
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.is_file() and not (out / f.name).exists() and f.suffix != ".safetensors" and f.name != "vlmrun_tiny.json":
            shutil.copy(f, out / f.name)
    return out, sum(p.numel() for p in model.parameters())


def vlmrun(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"vlmrun {args[0]} failed:\n{out.stderr[-3000:]}")


def recipe_sets(model: Path, data: Path, ranks: int) -> list[str]:
    items = [
        *("model.tiny=false", f"model.path={model}", f"data.path={data}"),
        "data.synthetic={" + ", ".join(f"{k}: {v}" for k, v in DATA.items()) + "}",
        *(f"parallel.dp={ranks}", "parallel.fsdp=true", f"cluster.cpus_per_node={ranks}"),
        *("train.max_steps=1", "checkpoint.save_period=1", "train.val_samples=0", "data.num_workers=0"),
        "logger.wandb_mode=disabled",
    ]
    return [arg for item in items for arg in ("--set", item)]


def attempt(run: Path) -> dict:
    """The run's last attempt as job.json records it."""
    return json.loads((run / "job.json").read_text())["attempts"][-1]


def cold(work: Path, sets: list[str], name: str) -> dict:
    run = work / name
    vlmrun("submit", str(RECIPE), "--cluster", "local", "--run-dir", str(run), *sets, "--wait")
    return attempt(run)


def resumed(work: Path, base: Path, name: str) -> dict:
    run = work / name
    shutil.copytree(base, run)
    vlmrun("resume", str(run), "--set", "train.max_steps=2", "--wait")
    return attempt(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="mid")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-resume-") as tmp:
        work = Path(tmp)
        model, params = save_model(args.size, work)
        ensure_clevr(work / "clevr", **DATA)
        sets = recipe_sets(model, work / "clevr", args.ranks)
        base = work / "cold-0"  # trains step 1 and seals its checkpoint: what every resume continues
        sides: dict[str, list[dict]] = {"cold": [], "resume": []}
        for n in range(args.rounds):  # interleaved, the order alternating
            for side in ("cold", "resume") if n % 2 == 0 else ("resume", "cold"):
                got = cold(work, sets, f"cold-{n}") if side == "cold" else resumed(work, base, f"resume-{n}")
                sides[side].append(got)
        checkpoint_bytes = sum(p.stat().st_size for p in (base / "checkpoints").rglob("*") if p.is_file())
    seconds = {side: [a["first_step_s"] for a in rows] for side, rows in sides.items()}
    report = {
        "size": args.size,
        "params": params,
        "ranks": args.ranks,
        "rounds": args.rounds,
        "checkpoint_bytes": checkpoint_bytes,
        "weights_bytes_bf16": 2 * params,
        **{
            side: {
                "first_step_s": seconds[side],
                "first_step_s_median": round(statistics.median(seconds[side]), 3),
                "policy_load": rows[0]["policy_load"],
            }
            for side, rows in sides.items()
        },
        "resume_over_cold_first_step": ratio_spread(round_ratios(seconds["resume"], seconds["cold"])),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
