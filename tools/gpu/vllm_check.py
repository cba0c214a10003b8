"""vLLM check: the product's `vllm` generation backend against its `hf` one on one GPU, as JSON.

    # on the GPU machine, after the two pieces of ../shared/gpu/vllm-carry.sh (docs/measurements.md):
    . /tmp/acc/env.sh && PYTHONPATH=.:$PYTHONPATH python3 tools/gpu/vllm_check.py --out $OUT/vllm_check.json

What runs is vlmrun's own code, no Ray, no recipe, no network: the `hf` policy (`open_policy`, one
FSDP2 rank, fp32 master weights, bf16 compute) of a random-init model of the Qwen2.5-VL-3B layout
(vlmrun/models/reference/qwen2_5_vl_3b.json, with the tiny builder's tokenizer and processor and its
special-token ids: no weights anywhere), and each engine from `open_generator` on the same GPU, filled
by the product's `refit` from the policy (`generation.refit_bucket_mb` 256). Per engine:

  setup_s, refit_s              opening the engine (weights from the refit), and one refit (3 timed)
  rollouts                      a GRPO rollout: --prompts prompts x G=8 responses (one 448 px image and a
                                CLEVR-length question each), at 16 and at 256 new tokens (one untimed
                                call first): tokens/s, and token_mult_prob_error (mean exp|engine logprob
                                - policy logprob| over the response tokens; median over responses) of the
                                engine's log-probs against the policy's teacher-forced ones
  sleep (vllm)                  release_weights (sleep level 2): seconds and the device memory freed
                                (cudaMemGetInfo), then the refit that wakes it: seconds
Then `vllm_over_hf_tokens_per_s` per length and the goals: >= 5x at 256 new tokens, refit < 2 s,
token_mult_prob_error median < 1.05. Exit status 0 when every part ran (goals are reported, not
enforced), 1 when one failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload

from vlmrun.algorithms.common.refit import refit
from vlmrun.data.batch import PromptBatch
from vlmrun.generation import open_generator
from vlmrun.generation.interface import SamplingParams
from vlmrun.models.spec import ModelSpec

GENERATIONS = 8
LENGTHS = (16, 256)
BUCKET = 256 << 20
QUESTION = "How many objects are there in the image? Answer with a single number."
COPIED = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja")
VLLM_OPTIONS = {"gpu_memory_utilization": 0.5, "max_model_len": 2048, "enforce_eager": False}


def model_dir(folder: Path) -> tuple[Path, dict]:
    """A model directory of the 3B layout with no weights: the tiny builder's tokenizer and processor,
    and a config whose special-token ids are theirs (the 3B's vocabulary size kept); and that config."""
    from vlmrun.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model("qwen2_5_vl", folder / "tiny", seed=0)
    small = json.loads((tiny / "config.json").read_text())
    ids = {k: small[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    text = {k: small["text_config"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = workload.model_config({**ids, "text_config": text})
    out = folder / "qwen2_5_vl_3b_layout"
    out.mkdir()
    for name in COPIED:
        shutil.copy(tiny / name, out / name)
    generation = json.loads((tiny / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(generation))
    (out / "config.json").write_text(json.dumps(config))
    return out, config


def prompts(directory: Path, count: int) -> PromptBatch:
    """`count` prompts as the GRPO prompt encoder makes them: the chat template with one 448 px image."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(directory)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    g = torch.Generator().manual_seed(0)
    images = [
        Image.fromarray(torch.randint(0, 256, (448, 448, 3), generator=g, dtype=torch.uint8).numpy())
        for _ in range(count)
    ]
    out = processor(images=images, text=[text] * count, return_tensors="pt", padding=True)
    token_inputs = {"mm_token_type_ids": out["mm_token_type_ids"]} if "mm_token_type_ids" in out else {}
    return PromptBatch(
        [f"p{i}" for i in range(count)],
        out["input_ids"],
        out["attention_mask"],
        ["3"] * count,
        media={"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]},
        token_inputs=token_inputs,
    )


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prob_error(policy, rollouts) -> dict:
    """token_mult_prob_error of the engine's log-probs against the policy's, per response."""
    scored = rollouts.response_logprobs(policy.logprobs(rollouts.training_batch()))
    mask = rollouts.response_mask.bool()
    ratio = torch.exp((scored - rollouts.logprobs).abs()).masked_fill(~mask, 0.0)
    per = (ratio.sum(1) / mask.sum(1).clamp(min=1)).tolist()
    return {"median": statistics.median(per), "max": max(per), "mean_over_tokens": float(ratio.sum() / mask.sum())}


def engine_report(backend: str, directory: Path, policy, batch: PromptBatch, rounds: int) -> dict:
    options = VLLM_OPTIONS if backend == "vllm" else None
    spec = ModelSpec(directory=str(directory), dtype="bfloat16")
    engine = open_generator(backend, model=spec, device="cuda", weights="refit", options=options)
    report: dict = {"backend": backend}
    try:
        report["setup_s"] = timed(engine.setup)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        refits = [timed(lambda: refit(engine, policy, bucket_bytes=BUCKET)) for _ in range(3)]
        report["refit_s"] = {"first": refits[0], "median": statistics.median(refits), "all": refits}
        report["refit_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
        report["rollouts"] = {}
        for length in LENGTHS:
            sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=length, seed=1234)
            engine.generate(batch, sampling, n=GENERATIONS)  # warm-up: graphs, kernels, caches
            runs = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = engine.generate(batch, sampling, n=GENERATIONS)
                torch.cuda.synchronize()
                runs.append((time.perf_counter() - t0, int(got.response_mask.sum())))
            seconds = statistics.median(s for s, _ in runs)
            tokens = statistics.median(t for _, t in runs)
            report["rollouts"][str(length)] = {
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "token_mult_prob_error": prob_error(policy, got),
            }
        if backend == "vllm":
            free = free_bytes()
            report["sleep_s"] = timed(engine.release_weights)
            report["sleep_freed_gib"] = (free_bytes() - free) / 2**30
            report["wake_refit_s"] = timed(lambda: refit(engine, policy, bucket_bytes=BUCKET))
    finally:
        engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    return report


def run(args) -> dict:
    report: dict = {"ok": True, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="vlmrun-vllm-check-") as tmp:
        directory, config = model_dir(Path(tmp))
        scale = workload.gpu_scale(seq_len=1024, steps=1, warmup_steps=0, activation_checkpointing=False)
        policy = workload.open_check_policy(config, scale, seed=0, mixed_precision="bf16")
        batch = prompts(directory, args.prompts)
        report["prompt_tokens"] = int(batch.attention_mask[0].sum())
        try:
            for backend in args.backends.split(","):
                try:
                    report["engines"][backend] = engine_report(backend, directory, policy, batch, args.rounds)
                except Exception as exc:  # noqa: BLE001 (one engine's failure is recorded; the other still runs)
                    report["ok"] = False
                    report["engines"][backend] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    report["engines"][backend]["traceback"] = traceback.format_exc()[-6000:]
        finally:
            policy.shutdown()
    engines = report["engines"]
    if all("rollouts" in engines.get(b, {}) for b in ("hf", "vllm")):
        report["vllm_over_hf_tokens_per_s"] = {
            n: engines["vllm"]["rollouts"][n]["tokens_per_s"] / engines["hf"]["rollouts"][n]["tokens_per_s"]
            for n in engines["vllm"]["rollouts"]
        }
    if "rollouts" in engines.get("vllm", {}):
        v = engines["vllm"]
        report["goals"] = {
            "vllm_over_hf_at_256_at_least_5": report.get("vllm_over_hf_tokens_per_s", {}).get("256", 0) >= 5,
            "refit_under_2_s": v["refit_s"]["median"] < 2,
            "token_mult_prob_error_median_under_1_05": v["rollouts"]["256"]["token_mult_prob_error"]["median"] < 1.05,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the JSON here (default: $OUT/vllm_check.json if set)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 responses)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rollouts per length and engine")
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: the vllm backend runs on a GPU only"}))
        return 2
    report = run(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    out = args.out or (Path(os.environ["OUT"]) / "vllm_check.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
