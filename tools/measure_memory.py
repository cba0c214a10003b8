"""The memory-fit estimate against the measured peak of one training step, as JSON.

    .venv/bin/python tools/measure_memory.py [--recipe recipes/tiny-clevr-cpu.yaml] [--family F ...] [--set k=v ...]
    PYTHONPATH=. python3 tools/measure_memory.py --gpu [--reference qwen2_5_vl_3b]   # one GPU, vlmrun not installed

CPU (the default), for each family: the tiny model (`create(seed=0)`) in the recipe's model.dtype,
one micro-batch of `train.micro_batch_size` sequences padded with text to `data.max_seq_len` tokens,
each with one `data.synthetic.image_size` px image (the bound the estimate assumes), and the recipe's
optimizer and activation checkpointing. One step warms up (AdamW allocates its state), then a second
step (zero grad, forward, the policy's NLL, backward, optimizer step) runs under torch.profiler with
profile_memory=True: its trace's largest "Total Allocated" is the peak of the bytes allocated during
that step by the CPU allocator, counted exactly per allocation and free (RSS moves in pages and
keeps freed memory, too coarse at these sizes). Measured peak = that + the bytes alive before the
step (parameters and optimizer state). Single process, so no FSDP: the CPU recipes run replicas.

--gpu: the reference architecture (random init on the GPU, no weights read) under FSDP2 on one rank
with fp32 master weights and bf16 mixed precision, as the GPU recipes run it, with and without
activation checkpointing; torch.cuda.max_memory_allocated over the second step against the estimate
without its fixed overhead (the CUDA context is not an allocation), and max_memory_reserved beside
it. Needs torch and transformers only (no pydantic): it reads no recipe.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from vlmrun.models.memory import TrainingShape, estimate_memory  # noqa: E402
from vlmrun.models.params import count_architecture  # noqa: E402
from vlmrun.policy.fsdp import Sharding, checkpoint_layers, decoder_layers, set_gradient_sync, shard_model  # noqa: E402
from vlmrun.policy.loss import nll_sum  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
FILLER = "The small red cube is left of the large blue sphere and behind the green cylinder. "


def padded_batch(processor, sequences: int, seq_len: int, image_size: int) -> dict:
    """`sequences` one-image conversations, each extended with plain text to exactly `seq_len` tokens."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "How many?"}]}]
    batch = processor.apply_chat_template(
        [turn] * sequences, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )
    ids = batch["input_ids"]
    if ids.shape[1] > seq_len:
        raise SystemExit(f"the prompt alone is {ids.shape[1]} tokens, more than data.max_seq_len={seq_len}")
    filler = torch.tensor(processor.tokenizer(FILLER * (seq_len // 4 + 1))["input_ids"][: seq_len - ids.shape[1]])
    extended = {"input_ids": torch.cat([ids, filler.expand(sequences, -1)], dim=1)}
    for key, value in batch.items():  # per-token fields (attention mask, token types) grow with the text
        if key != "input_ids" and torch.is_tensor(value) and value.shape == ids.shape:
            pad = torch.full((sequences, len(filler)), 1 if key == "attention_mask" else 0, dtype=value.dtype)
            extended[key] = torch.cat([value, pad], dim=1)
    return dict(batch) | extended


def measure_family(family: str, recipe) -> dict:
    """Estimated and measured bytes of one step of `family`'s tiny model under `recipe`."""
    from vlmrun.config.dtype import torch_dtype
    from vlmrun.models.architecture import load_architecture
    from vlmrun.models.fit import training_shape
    from vlmrun.models.tiny import family_module

    shape, assumption = training_shape(recipe)
    model, processor = family_module(family).create(seed=0)
    dtype = torch_dtype(recipe.model.dtype)
    model = model.to(dtype).train()
    if recipe.parallel.activation_checkpointing:
        checkpoint_layers(model, decoder_layers(model))
    batch = padded_batch(processor, shape.sequences, shape.seq_len, shape.image_size)
    batch = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in batch.items()}
    t = recipe.train
    optimizer_cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.SGD
    optimizer = optimizer_cls(model.parameters(), lr=1e-4, foreach=False)

    def step() -> None:  # the recipe's micro-batches per step, gradients accumulated as the replicas do
        optimizer.zero_grad(set_to_none=True)
        for _ in range(shape.micro_batches):
            logits = model(**batch, use_cache=False).logits
            (nll_sum(logits, batch["input_ids"]) / batch["input_ids"].numel()).backward()
        optimizer.step()

    step()
    alive = sum(p.numel() * p.element_size() for p in model.parameters())
    alive += sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    measured = alive + profiled_peak(step)
    estimate = estimate_memory(load_architecture(recipe.model).architecture, shape)
    return {
        "family": family,
        "params": estimate.params,
        "tokens": int(batch["input_ids"].numel()),
        "micro_batches": shape.micro_batches,
        "assumption": assumption,
        "estimate_bytes": estimate.device_total,
        "estimate_terms": estimate.peak_terms(),
        "measured_peak_bytes": measured,
        "alive_before_step_bytes": alive,
        "ratio_estimate_to_measured": round(estimate.device_total / measured, 3),
    }


def profiled_peak(fn) -> int:
    """Peak bytes allocated (and not yet freed) by the CPU allocator while `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_file))
        events = json.loads(trace_file.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def qwen_batch(config, sequences: int, seq_len: int, image_size: int, device: str) -> dict:
    """`sequences` Qwen2.5-VL rows of `seq_len` tokens: random text around one `image_size` px image of
    random patches; labels are the ids with the image tokens masked."""
    vision, g = config.vision_config, torch.Generator().manual_seed(0)
    grid = image_size // vision.patch_size
    image = grid * grid // vision.spatial_merge_size**2
    first_special = min(config.image_token_id, config.vision_start_token_id, config.vision_end_token_id)
    ids = torch.randint(0, first_special, (sequences, seq_len), generator=g)
    ids[:, 8], ids[:, 9 + image] = config.vision_start_token_id, config.vision_end_token_id
    ids[:, 9 : 9 + image] = config.image_token_id
    is_image = ids == config.image_token_id
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": is_image.long(),
        "pixel_values": torch.randn(sequences * grid * grid, row, generator=g),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * sequences),
        "labels": ids.masked_fill(is_image, -100),
    }
    return {k: v.to(device) for k, v in batch.items()}


def attention_kernels(fused_only: bool):
    """SDPA restricted to the fused kernels (flash, memory-efficient: no seq_len^2 scores), or as is."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not fused_only:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def sharded_reference(reference: str, checkpointing: bool):
    """(config dict, HF config, model, AdamW) of `reference` built on the GPU and sharded with FSDP2 on
    the one-rank process group: fp32 master weights, bf16 compute."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = json.loads((ROOT / "vlmrun" / "models" / "reference" / f"{reference}.json").read_text())
    config.pop("source", None)
    hf_config = AutoConfig.for_model(**config)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(hf_config)
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (1,))
    try:
        shard_model(model, mesh, Sharding(mixed_precision="bf16", activation_checkpointing=checkpointing))
    except AttributeError:  # an older torch lacks a comms setter shard_model calls last; on one rank it is moot
        pass
    return config, hf_config, model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)


def measure_gpu(
    reference: str,
    *,
    checkpointing: bool,
    sequences: int,
    seq_len: int,
    image_size: int = 448,
    micro_batches: int = 1,
    fused_attention_only: bool = False,
) -> dict:
    """Peak CUDA allocation of the second training step of `reference` against the estimate of the
    same shape (`estimate_without_overhead`: the CUDA context is no allocation)."""
    import inspect

    config, hf_config, model, optimizer = sharded_reference(reference, checkpointing)
    batch = qwen_batch(hf_config, sequences, seq_len, image_size, "cuda")
    if "mm_token_type_ids" not in inspect.signature(model.model.forward).parameters:
        batch.pop("mm_token_type_ids")
    labels = batch.pop("labels")

    def step() -> None:  # as the policy's train_step: gradients reduce-scattered after the last micro-batch
        optimizer.zero_grad(set_to_none=True)
        for k in range(micro_batches):
            set_gradient_sync(model, k == micro_batches - 1)
            (nll_sum(model(**batch, use_cache=False).logits, labels) / labels.numel()).backward()
        optimizer.step()

    shape = TrainingShape(
        micro_batches=micro_batches,
        fsdp=True,
        mixed_precision="bf16",
        activation_checkpointing=checkpointing,
        sequences=sequences,
        seq_len=seq_len,
        image_size=image_size,
    )
    estimate = estimate_memory(count_architecture("qwen2_5_vl", config), shape)
    row = {"reference": reference, "activation_checkpointing": checkpointing, "micro_batches": micro_batches}
    row |= {"sequences": sequences, "seq_len": seq_len, "attention": hf_config.text_config._attn_implementation}
    row |= {
        "estimate_bytes": estimate.device_total,
        "estimate_without_overhead": estimate.device_total - estimate.overhead,
    }
    row["estimate_terms"] = {k: v for k, v in estimate.to_json().items() if type(v) is int}
    row["fused_attention_only"] = fused_attention_only
    try:
        with attention_kernels(fused_attention_only):
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        return row | {"failed": str(e).splitlines()[0][:300]}
    row |= {"allocated_peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()}
    row["ratio_estimate_to_allocated"] = round(row["estimate_without_overhead"] / row["allocated_peak"], 3)
    return row


# the 1n2g Qwen recipe's micro-batch (4 x 2048 tokens, 448 px) with and without activation checkpointing and
# gradient accumulation, and the same tokens as 8 shorter sequences (attention's seq_len^2 term, if any)
GPU_CASES = [
    {"checkpointing": True, "sequences": 4, "seq_len": 2048},
    {"checkpointing": True, "sequences": 4, "seq_len": 2048, "micro_batches": 2},
    {"checkpointing": False, "sequences": 4, "seq_len": 2048},
    {"checkpointing": False, "sequences": 4, "seq_len": 2048, "fused_attention_only": True},
    {"checkpointing": False, "sequences": 8, "seq_len": 1024},
]


def gpu_rows(reference: str) -> list[dict]:
    """Every case of GPU_CASES, in one process group."""
    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    try:
        rows = []
        for case in GPU_CASES:
            gc.collect()  # FSDP's hooks hold the last case's model in reference cycles
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            rows.append(measure_gpu(reference, **case) | {"allocated_before_case": before})
        return rows
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--family", action="append", help="qwen2_5_vl or nemotron_omni; default: both")
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. data.max_seq_len=512")
    parser.add_argument("--gpu", action="store_true", help="the reference architecture on this machine's GPU")
    parser.add_argument("--reference", default="qwen2_5_vl_3b", help="with --gpu: a Qwen2.5-VL reference config")
    args = parser.parse_args()
    if args.gpu:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": gpu_rows(args.reference)}, indent=2))
        return
    from vlmrun.config.families import FAMILIES
    from vlmrun.config.load import load_recipe

    torch.set_num_threads(1)
    rows = []
    for family in args.family or FAMILIES:  # an unknown family is refused by the recipe
        recipe = load_recipe(args.recipe, [*args.set, f"model.family={family}", f"data.family={family}"])
        rows.append(measure_family(family, recipe))
    print(json.dumps({"recipe": str(args.recipe), "overrides": args.set, "families": rows}, indent=2))


if __name__ == "__main__":
    main()
