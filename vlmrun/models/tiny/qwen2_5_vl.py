"""Tiny Qwen2.5-VL: random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen2_5_VLForConditionalGeneration`).
A 112x112 image is 8x8 patches of 14 px, merged 2x2 into 16 `<|image_pad|>` tokens; images from
56x56 up to 448x448 (multiples of 28) keep their size, bigger ones are scaled down to 448*448 pixels.
Tokenizer, template and processor layout are the Qwen families' (qwen.py); the vision tower is
Qwen2.5-VL's: RMSNorm, gated MLP, windowed attention with full attention in `fullatt_block_indexes`.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.models.tiny import qwen

TOKENIZER_SPEC = qwen.TOKENIZER_SPEC
NEVER_GENERATED = qwen.NEVER_GENERATED
CHAT_TEMPLATE = qwen.CHAT_TEMPLATE

PATCH_SIZE = 14
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448


def build_processor():
    """The processor (tokenizer, image and video processors, chat template); deterministic."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

    return qwen.build_processor(
        Qwen2_5_VLProcessor, Qwen2VLVideoProcessor, patch_size=PATCH_SIZE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )


def build_config(tokenizer):
    """Config of ~0.6M parameters: text hidden 128 x 2 layers, vision hidden 32 x 2 blocks."""
    from transformers import Qwen2_5_VLConfig

    # mrope splits head_dim / 2 rotary frequencies over (time, height, width)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": qwen.MERGE_SIZE,
        "temporal_patch_size": qwen.TEMPORAL_PATCH_SIZE,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": qwen.TEXT_HIDDEN,
    }
    return Qwen2_5_VLConfig(
        text_config=qwen.text_config(tokenizer, rope_parameters=rope, max_window_layers=2),
        vision_config=vision_config,
        tie_word_embeddings=False,
        **qwen.vision_token_ids(tokenizer),
    )


def create(*, seed: int):
    """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = build_processor()
    config = build_config(processor.tokenizer)
    return qwen.random_model(Qwen2_5_VLForConditionalGeneration, config, processor.tokenizer, seed=seed), processor


def build(out_dir: Path, *, seed: int) -> None:
    """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
    qwen.save(*create(seed=seed), out_dir)
