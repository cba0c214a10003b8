"""What the GPU check runs: model configs, synthetic Qwen2.5-VL batches and the FLOPs of a training step.

Only torch and transformers are imported. Configs are built from `vlmrun/models/reference/qwen2_5_vl_3b.json`
with overrides applied to the plain dict before `Qwen2_5_VLConfig(**d)`, so the same code works with the
transformers that renamed `rope_scaling` to `rope_parameters` and with later ones (no weights are
downloaded; every model is random-init from a seed).

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
from dataclasses import dataclass
from pathlib import Path

import torch

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


def build_config(overrides: dict):
    """A `Qwen2_5_VLConfig` of the 3B reference with `overrides` (see TINY_OVERRIDES)."""
    from transformers import Qwen2_5_VLConfig

    d = merged(json.loads(REFERENCE_CONFIG.read_text()), overrides)
    d.pop("architectures", None)
    d.pop("model_type", None)
    return Qwen2_5_VLConfig(**d)


def build_model(config, *, device: str, seed: int, dtype: torch.dtype = torch.float32):
    """A random-init `Qwen2_5_VLForConditionalGeneration` created directly on `device` (no weights are
    read); the global RNG is left as it was."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    devices = [torch.cuda.current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.to(dtype)


def synthetic_batch(config, *, seq_len: int, image_side: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """One sequence of `seq_len` tokens in the Qwen2.5-VL format: 8 text tokens, one square image of
    `image_side` px (a multiple of 28) between its vision start/end tokens, then text; random pixels and
    token ids from `seed`. Labels are the input ids with the image tokens masked (-100)."""
    vision = config.vision_config
    grid = image_side // vision.patch_size
    image_tokens = grid * grid // vision.spatial_merge_size**2
    if seq_len < image_tokens + 12:
        raise ValueError(f"seq_len {seq_len} is too short for a {image_side} px image ({image_tokens} tokens)")
    specials = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    text_ids = min(config.text_config.vocab_size, *specials)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text_ids, (seq_len,), generator=g)
    ids[8] = config.vision_start_token_id
    ids[9 : 9 + image_tokens] = config.image_token_id
    ids[9 + image_tokens] = config.vision_end_token_id
    is_image = ids == config.image_token_id
    labels = ids.masked_fill(is_image, -100)
    batch = {
        "input_ids": ids[None],
        "attention_mask": torch.ones(1, seq_len, dtype=torch.long),
        "mm_token_type_ids": is_image.long()[None],
        "pixel_values": torch.randn(grid * grid, PATCH_ROW, generator=g),
        "image_grid_thw": torch.tensor([[1, grid, grid]]),
        "labels": labels[None],
    }
    return {k: v.to(device) for k, v in batch.items()}


def matmul_params(module: torch.nn.Module) -> int:
    """Elements of the weights with >= 2 dims under `module` (its matmul and convolution weights)."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def training_flops(model, config, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """FLOPs of one forward + backward over `batch`, by term (see the module docstring); call it before
    sharding (parameter counts) on a model from `build_model`."""
    text, vision = config.text_config, config.vision_config
    batch_size, seq = batch["input_ids"].shape
    patches = batch["pixel_values"].shape[0]
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
