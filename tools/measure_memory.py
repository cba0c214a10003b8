"""The memory-fit estimate against the measured peak of one training step of the policy, as JSON.

    .venv/bin/python tools/measure_memory.py [--recipe recipes/tiny-clevr-cpu.yaml] [--family F ...] [--set k=v ...]

On the GPU the same comparison is a section of the GPU check (`tools/gpu/check.py --sections memory_fit`).

CPU, for each family: the recipe's policy (opened as a run's rank opens it, `open_rank_policy`, with
the recipe's model, train and parallel sections: the tiny model in model.dtype, the recipe's optimizer and activation
checkpointing) on one rank, and the recipe's micro-batches per step, each of `train.micro_batch_size`
sequences padded with text to `data.max_seq_len` tokens, each with one `data.synthetic.image_size` px
image (the bound the estimate assumes). One `train_step` warms up (AdamW allocates its state), then a
second one runs under torch.profiler with profile_memory=True: its trace's largest "Total Allocated" is
the peak of the bytes allocated during that step by the CPU allocator, counted exactly per allocation
and free (RSS moves in pages and keeps freed memory, too coarse at these sizes). Measured peak = that +
the bytes alive before the step (the policy's checkpoint state: weights and optimizer state). Single
process, so the CPU recipes' replicas, not FSDP.

A GRPO recipe (`--recipe recipes/tiny-grpo-cpu.yaml`) is measured per phase of its step, each against
the estimate of that phase (resident terms + the phase's own): the refit (the rank's engine, opened as
a training rank opens it, `weights="refit"`, filled from the policy in `generation.refit_bucket_mb`
buckets), the generation (one call, as a rank's rollout makes it: `grpo.num_generations` responses to each
of the replica's one-image prompts of the step padded with text to `data.max_seq_len` tokens, the longest prompt a run takes and the bound the
estimate assumes, to `grpo.max_new_tokens`: a random tiny model stops only there), and the training step (as
above, its sequences the prompt plus the responses, the last `grpo.max_new_tokens` of each labelled). The bytes alive before a phase are the policy's
state, its gradients from the step before, the reference model's weights and the engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from vlmrun.models.memory import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
FILLER = "The small red cube is left of the large blue sphere and behind the green cylinder. "


def padded_batch(processor, sequences: int, seq_len: int | None, image_size: int, dtype: torch.dtype):
    """`sequences` one-image conversations, each extended with plain text to exactly `seq_len` tokens (None:
    the prompt alone), as a `Batch` (every token labelled; pixels in the weights' `dtype`)."""
    import numpy as np
    from PIL import Image

    from vlmrun.data.batch import Batch

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "How many?"}]}]
    batch = processor.apply_chat_template(
        [turn] * sequences, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )
    ids = batch["input_ids"]
    seq_len = ids.shape[1] if seq_len is None else seq_len
    if ids.shape[1] > seq_len:
        raise SystemExit(f"the prompt alone is {ids.shape[1]} tokens, more than data.max_seq_len={seq_len}")
    filler = torch.tensor(
        processor.tokenizer(FILLER * (seq_len // 4 + 1))["input_ids"][: seq_len - ids.shape[1]], dtype=ids.dtype
    )
    extended = {"input_ids": torch.cat([ids, filler.expand(sequences, -1)], dim=1)}
    for key, value in batch.items():  # per-token fields (attention mask, token types) grow with the text
        if key != "input_ids" and torch.is_tensor(value) and value.shape == ids.shape:
            pad = torch.full((sequences, len(filler)), 1 if key == "attention_mask" else 0, dtype=value.dtype)
            extended[key] = torch.cat([value, pad], dim=1)
    media = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items() if k not in extended}
    ids, mask = extended.pop("input_ids"), extended.pop("attention_mask")
    names = [f"padded-{k}" for k in range(sequences)]
    return Batch(names, ids, mask, ids.clone(), media=media, token_inputs=extended)


def one_image_per_prompt(batch, group: int, family: str):
    """`batch` as GRPO lays out a micro-batch: each `group` consecutive rows (a prompt's responses) hold
    one copy of their image, which the policy encodes once for them (models/shared_images.py)."""
    import dataclasses

    from vlmrun.config.families import family_spec
    from vlmrun.models.shared_images import share_images

    pixels, grid = family_spec(family).media_keys
    per_image = batch.media[pixels].shape[0] // len(batch)  # padded_batch: one image per row, all alike
    per_row = [
        {pixels: batch.media[pixels][i * per_image : (i + 1) * per_image], grid: batch.media[grid][i : i + 1]}
        for i in range(len(batch))
    ]
    media, source = share_images(per_row, [i // group for i in range(len(batch))], pixels=pixels, grid=grid)
    return dataclasses.replace(batch, media=media, image_source=source)


def measure_family(family: str, recipe, cache: Path | None = None) -> dict:
    """Estimated and measured bytes of one step of `family`'s tiny model under `recipe` (the model is
    built into `cache`, default a temporary folder)."""
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="vlmrun-measure-memory-") as tmp:
            return measure_family(family, recipe, Path(tmp))
    from transformers import AutoProcessor

    from vlmrun.config.dtype import torch_dtype
    from vlmrun.models.architecture import load_architecture
    from vlmrun.models.fit import training_shape
    from vlmrun.models.source import ensure_model

    shape, assumption = training_shape(recipe)
    model_dir = str(ensure_model(recipe.model, cache, seed=0))
    policy = rank_policy(recipe, model_dir, max_steps=recipe.train.max_steps)
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        micro = [
            padded_batch(processor, shape.sequences, shape.seq_len, shape.image_size, torch_dtype(recipe.model.dtype))
        ]
        policy.train_step(micro * shape.micro_batches)
        alive = _state_bytes(policy.checkpoint_state().parts)
        measured = alive + profiled_peak(lambda: policy.train_step(micro * shape.micro_batches))
    finally:
        policy.shutdown()
    # the step measured is a training step: no generation engine beside it (its refit phase is not measured here)
    estimate = estimate_memory(load_architecture(recipe.model).architecture, dataclasses.replace(shape, engine=False))
    return {
        "family": family,
        "params": estimate.params,
        "tokens": int(micro[0].input_ids.numel()),
        "micro_batches": shape.micro_batches,
        "assumption": assumption,
        "estimate_bytes": estimate.device_total,
        "estimate_terms": estimate.peak_terms(),
        "measured_peak_bytes": measured,
        "alive_before_step_bytes": alive,
        "ratio_estimate_to_measured": round(estimate.device_total / measured, 3),
    }


def measure_grpo_phases(family: str, recipe, cache: Path | None = None) -> dict:
    """Estimated and measured bytes of each phase of a GRPO step of `family`'s tiny model under `recipe`."""
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="vlmrun-measure-memory-") as tmp:
            return measure_grpo_phases(family, recipe, Path(tmp))
    from transformers import AutoProcessor

    from vlmrun.algorithms.common.rank_backends import open_rank_engine
    from vlmrun.algorithms.common.refit import refit
    from vlmrun.config.dtype import torch_dtype
    from vlmrun.data.batch import IGNORE_INDEX, PromptBatch
    from vlmrun.generation.interface import SamplingParams
    from vlmrun.models.architecture import load_architecture
    from vlmrun.models.fit import rollout_sequences, training_shape
    from vlmrun.models.source import ensure_model

    shape, assumption = training_shape(recipe)
    g, t = recipe.grpo, recipe.train
    model_dir = str(ensure_model(recipe.model, cache, seed=0))
    policy = rank_policy(recipe, model_dir, max_steps=t.max_steps)
    engine = open_rank_engine(recipe, model_dir, gpus=False)
    engine.setup()
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        dtype = torch_dtype(recipe.model.dtype)
        train = [
            one_image_per_prompt(
                padded_batch(processor, shape.sequences, shape.seq_len, shape.image_size, dtype),
                g.num_generations,
                family,
            )
        ]
        train[0].labels[:, : -g.max_new_tokens] = IGNORE_INDEX  # a GRPO row's labels are its response
        n = rollout_sequences(recipe) // g.num_generations  # the step's prompts of one replica: one generate call
        one = padded_batch(processor, n, recipe.data.max_seq_len, shape.image_size, dtype)
        prompts = PromptBatch(
            [f"p{i}" for i in range(n)],
            one.input_ids,
            one.attention_mask,
            ["3"] * n,
            media=one.media,
            token_inputs=one.token_inputs,
        )
        sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)
        policy.train_step(train * shape.micro_batches)  # AdamW's state, and the gradients a next step starts with
        if g.kl_coef > 0:
            policy.reference_logprobs(train[0])  # builds the reference model
        measured = {}

        def alive() -> int:
            grads = _state_bytes([p.grad for p in policy.params if p.grad is not None])
            reference = getattr(policy, "_reference", None)
            ref = _state_bytes(dict(reference.state_dict())) if reference is not None else 0
            return _state_bytes(policy.checkpoint_state().parts) + grads + ref + _state_bytes(engine.model.state_dict())

        bucket = recipe.generation.refit_bucket_mb << 20
        measured["refit"] = alive() + profiled_peak(lambda: refit(engine, policy, bucket_bytes=bucket))
        measured["generation"] = alive() + profiled_peak(
            lambda: engine.generate(prompts, sampling, n=g.num_generations)
        )
        if recipe.generation.release_weights:
            engine.release_weights()
        before = alive()
        policy.optimizer.zero_grad(set_to_none=True)  # the step starts so: its gradients are made in it
        measured["training"] = (
            before - _grad_bytes(policy) + profiled_peak(lambda: policy.train_step(train * shape.micro_batches))
        )
    finally:
        policy.shutdown()
        engine.shutdown()
    estimate = estimate_memory(load_architecture(recipe.model).architecture, shape)
    estimated = {
        "refit": estimate.phase_total("refit"),
        "generation": estimate.phase_total("generation"),
        "training": max(estimate.phase_total("forward"), estimate.phase_total("backward")),
    }
    return {
        "family": family,
        "params": estimate.params,
        "assumption": assumption,
        "estimate_bytes": estimate.device_total,
        "estimate_peak_phase": estimate.peak_phase,
        "measured_peak_bytes": max(measured.values()),
        "phases": {
            k: {
                "estimate_bytes": estimated[k],
                "measured_bytes": measured[k],
                "ratio": round(estimated[k] / measured[k], 3),
            }
            for k in measured
        },
        "ratio_estimate_to_measured": round(estimate.device_total / max(measured.values()), 3),
    }


def _grad_bytes(policy) -> int:
    return _state_bytes([p.grad for p in policy.params if p.grad is not None])


def _state_bytes(value, seen: set | None = None) -> int:
    """Bytes of the distinct tensors in a (nested) state: a tied weight counts once."""
    seen = set() if seen is None else seen
    if torch.is_tensor(value):
        if value.data_ptr() in seen:
            return 0
        seen.add(value.data_ptr())
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_state_bytes(v, seen) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_state_bytes(v, seen) for v in value)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_policy(recipe, model_dir: str, *, max_steps: int):
    """The recipe's policy over `model_dir` as one CPU rank of a run opens it (the product's
    open_rank_policy), set up for `max_steps` steps."""
    from vlmrun.algorithms.common.rank_backends import open_rank_policy

    policy = open_rank_policy(recipe, model_dir, rank=0, world_size=1, parallel=recipe.parallel, gpus=False)
    policy.setup(master_addr="127.0.0.1", master_port=_free_port(), max_steps=max_steps)
    return policy


def profiled_peak(fn) -> int:
    """Peak bytes allocated (and not yet freed) by the CPU allocator while `fn` runs, as this thread sees
    them: torch.profiler counts an allocation or free made on another thread (a process group's worker:
    gloo lets a collective's tensors go there) neither in nor out, so where `fn`'s tensors are freed
    there the count only grows (rss_peak counts every thread)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_file))
        events = json.loads(trace_file.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    # torch's count of the bytes allocated carries over from one profile to the next (an allocation made
    # in an earlier profile and freed outside any is never taken off it): the peak is above this
    # profile's own start, the count before its first allocation or free
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in memory) - start


def status_kb(key: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_peak(fn) -> tuple[int, float]:
    """Peak resident bytes of this process while `fn` runs beyond those before it, every thread counted
    (VmHWM after resetting it through /proc/self/clear_refs, less VmRSS before). The heap's free memory
    is given back first (malloc_trim), so `fn`'s allocations fault in pages of their own; page-grained,
    and what `fn` frees into the heap stays counted until it is reused. With `fn`'s seconds."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return (status_kb("VmHWM") - before) << 10, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--family", action="append", help="a family of vlmrun/config/families.py; default: every one")
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. data.max_seq_len=512")
    args = parser.parse_args()
    from vlmrun.config.families import FAMILIES
    from vlmrun.config.load import load_recipe

    torch.set_num_threads(1)
    rows = []
    for family in args.family or FAMILIES:  # an unknown family is refused by the recipe
        recipe = load_recipe(args.recipe, [*args.set, f"model.family={family}", f"data.family={family}"])
        rows.append((measure_grpo_phases if recipe.train.algorithm == "grpo" else measure_family)(family, recipe))
    print(json.dumps({"recipe": str(args.recipe), "overrides": args.set, "families": rows}, indent=2))


if __name__ == "__main__":
    main()
