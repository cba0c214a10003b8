"""What the GPU check runs: the policy it opens, model configs, synthetic Qwen2.5-VL batches and the FLOPs
of a training step.

The policy is vlmrun's own, from `vlmrun.policy.open_policy("hf", ...)` with a `ModelSpec` of a config
(random init: built on the meta device, each rank materializing only its shards), so every section
runs the code a training rank runs. Configs are `vlmrun/models/reference/qwen2_5_vl_3b.json` with
overrides merged into the plain dict; no weights are read. `TRAIN` and `parallel` stand in for the
recipe sections the policy reads (the check reads no recipe: the GPU machine has no pydantic).

FLOPs of one training step (forward + backward = 3 x forward), the PaLM appendix-B convention:
1. matmuls: 6 x (weights with >= 2 dims) x (rows they multiply): the text decoder layers and the LM head
   over every sequence position, the vision blocks and patch embedding over every patch, the vision
   merger over patches / merge^2. Embedding lookups, norms and biases are not counted.
2. attention scores and values: 12 x layers x (query heads x head_dim) x S x context per sequence, with
   context = S for text (causal masking NOT halved, as in PaLM and torchtitan), = all patches for the
   vision full-attention blocks and = the window's patches for the windowed ones.
Activation-checkpoint recomputation is not counted (it is overhead, not useful work), so MFU with it on
is lower for the same hardware efficiency.
"""

from __future__ import annotations

import copy
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from vlmrun.data.batch import IGNORE_INDEX, Batch
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "vlmrun" / "models" / "reference" / "qwen2_5_vl_3b.json"

# A ~0.2M-parameter model with the 3B layout, for --cpu-smoke: head_dim 16 -> mrope over 8 frequencies.
TINY_OVERRIDES = {
    "text_config": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": 500,
        "eos_token_id": 501,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    },
    "image_token_id": 508,
    "video_token_id": 509,
    "vision_start_token_id": 510,
    "vision_end_token_id": 511,
}
# The 3B layout cut to 2 decoder layers and 2 vision blocks (vocabulary and widths kept): ~0.5B params.
CUT_DOWN_OVERRIDES = {
    "text_config": {"num_hidden_layers": 2},
    "vision_config": {"depth": 2, "fullatt_block_indexes": [1]},
}
PATCH_ROW = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch: one pixel_values row
#: The recipe's train section as the policy reads it: AdamW without weight decay, a constant LR, the
#: recipes' gradient clipping.
TRAIN = SimpleNamespace(
    seed=0,
    optimizer="adamw",
    lr=1e-5,
    betas=(0.9, 0.999),
    weight_decay=0.0,
    warmup_steps=0,
    lr_schedule="constant",
    min_lr_ratio=1.0,
    grad_clip=1.0,
)


@dataclass(frozen=True, kw_only=True)
class Scale:
    """How big each section runs: the 3B model on a GPU, a tiny one for --cpu-smoke."""

    device: str
    backend: str
    train_overrides: dict
    dcp_overrides: dict
    seq_len: int
    dcp_seq_len: int
    image_side: int
    warmup_steps: int
    steps: int
    matmul_sizes: tuple[int, ...]
    activation_checkpointing: bool = False


def gpu_scale(*, seq_len: int, steps: int, warmup_steps: int, activation_checkpointing: bool) -> Scale:
    """The full check: the 3B config for training and logprobs, its cut-down for DCP, one 448 px image."""
    return Scale(
        device="cuda",
        backend="cuda:nccl,cpu:gloo",
        train_overrides={},
        dcp_overrides=CUT_DOWN_OVERRIDES,
        seq_len=seq_len,
        dcp_seq_len=min(seq_len, 1024),
        image_side=448,
        warmup_steps=warmup_steps,
        steps=steps,
        matmul_sizes=(4096, 8192, 16384),
        activation_checkpointing=activation_checkpointing,
    )


def cpu_smoke_scale(*, seq_len: int, steps: int, warmup_steps: int, activation_checkpointing: bool) -> Scale:
    """Every code path on CPU with gloo and the tiny config, in seconds."""
    return Scale(
        device="cpu",
        backend="gloo",
        train_overrides=TINY_OVERRIDES,
        dcp_overrides=TINY_OVERRIDES,
        seq_len=seq_len,
        dcp_seq_len=seq_len,
        image_side=112,
        warmup_steps=warmup_steps,
        steps=steps,
        matmul_sizes=(128, 256),
        activation_checkpointing=activation_checkpointing,
    )


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` applied recursively (dicts merge, anything else replaces); a new dict."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def model_config(overrides: dict) -> dict:
    """The 3B reference config.json content with `overrides` (see TINY_OVERRIDES), for a ModelSpec."""
    return merged(json.loads(REFERENCE_CONFIG.read_text()), overrides)


def sharded_parallel(mixed_precision: str = "none", activation_checkpointing: bool = False) -> SimpleNamespace:
    """The recipe's `parallel` section as the policy reads it, for an FSDP2 layout (no offload, gradients
    reduced once per step)."""
    return SimpleNamespace(
        fsdp=True,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=False,
        reduce_every_micro_batch=False,
    )


def open_check_policy(
    config: dict, scale: Scale, *, seed: int, mixed_precision: str = "bf16", activation_checkpointing: bool = False
):
    """vlmrun's hf policy, set up as the one rank of a sharded (FSDP2) layout on `scale.device`: fp32
    master weights random-init from `seed`, `mixed_precision` compute. Call `shutdown()` after it."""
    parallel = sharded_parallel(mixed_precision, activation_checkpointing)
    policy = open_policy(
        "hf",
        model=ModelSpec(config=config, seed=seed),
        rank=0,
        world_size=1,
        train=TRAIN,
        parallel=parallel,
        gpus=scale.device == "cuda",
    )
    policy.setup(master_addr="127.0.0.1", master_port=free_port(), max_steps=1000)
    return policy


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for the policy's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_batch(config: dict, *, seq_len: int, image_side: int, seed: int, sequences: int = 1) -> Batch:
    """`sequences` sequences of `seq_len` tokens in the Qwen2.5-VL format, as the task encoder makes them
    (on the CPU; the policy moves them): 8 text tokens, one square image of `image_side` px (a multiple
    of 28) between its vision start/end tokens, then text; random pixels and token ids from `seed`.
    Labels are the input ids with the image tokens masked."""
    vision = config["vision_config"]
    grid = image_side // vision["patch_size"]
    image_tokens = grid * grid // vision["spatial_merge_size"] ** 2
    if seq_len < image_tokens + 12:
        raise ValueError(f"seq_len {seq_len} is too short for a {image_side} px image ({image_tokens} tokens)")
    image, start, end = config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]
    text_ids = min(config["text_config"]["vocab_size"], image, config["video_token_id"], start, end)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text_ids, (sequences, seq_len), generator=g)
    ids[:, 8] = start
    ids[:, 9 : 9 + image_tokens] = image
    ids[:, 9 + image_tokens] = end
    is_image = ids == image
    return Batch(
        sample_ids=[f"synthetic-{seed}-{k}" for k in range(sequences)],
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=ids.masked_fill(is_image, IGNORE_INDEX),
        media={
            "pixel_values": torch.randn(sequences * grid * grid, PATCH_ROW, generator=g),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * sequences),
        },
        token_inputs={"mm_token_type_ids": is_image.long()},
    )


def matmul_params(module: torch.nn.Module) -> int:
    """Elements of the weights with >= 2 dims under `module` (its matmul and convolution weights)."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def training_flops(model, batch: Batch) -> dict[str, float]:
    """FLOPs of one forward + backward over `batch`, by term (see the module docstring); `model` is the
    unsharded architecture (`vlmrun.models.build.build_model(spec, on_meta=True)`: no memory)."""
    config = model.config
    text, vision = config.text_config, config.vision_config
    batch_size, seq = batch.input_ids.shape
    patches = batch.media["pixel_values"].shape[0]
    lm = model.model.language_model
    visual = model.model.visual
    text_rows = batch_size * seq
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    window = min(patches, (vision.window_size // vision.patch_size) ** 2)
    full_blocks = len(vision.fullatt_block_indexes)
    vision_context = full_blocks * patches + (vision.depth - full_blocks) * window
    terms = {
        "text_matmul": 6.0 * (matmul_params(lm.layers) + model.lm_head.weight.numel()) * text_rows,
        "vision_matmul": 6.0
        * (
            (matmul_params(visual.blocks) + matmul_params(visual.patch_embed)) * patches
            + matmul_params(visual.merger) * patches / vision.spatial_merge_size**2
        ),
        "text_attention": 12.0 * text.num_hidden_layers * text.num_attention_heads * head_dim * seq * seq * batch_size,
        "vision_attention": 12.0 * vision.hidden_size * patches * vision_context,
    }
    terms["total"] = sum(terms.values())
    return terms
