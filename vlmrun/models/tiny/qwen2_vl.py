"""Tiny Qwen2-VL: random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen2VLForConditionalGeneration`).
Images are cut as Qwen2.5-VL's (14 px patches merged 2x2: a 112x112 image is 16 `<|image_pad|>`
tokens; 56x56 up to 448x448 keep their size), with the same tokenizer, template and text model
(qwen.py). The vision tower is Qwen2-VL's: LayerNorm, a plain 2-layer MLP (`mlp_ratio`), full
attention in every block; its config calls the tower's width `embed_dim` and the merger's output
(the text model's width) `hidden_size`.
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
    from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

    return qwen.build_processor(
        Qwen2VLProcessor, Qwen2VLVideoProcessor, patch_size=PATCH_SIZE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )


def build_config(tokenizer):
    """Config of ~0.6M parameters: text hidden 128 x 2 layers, vision width 32 x 2 blocks."""
    from transformers import Qwen2VLConfig

    # Qwen2-VL's [16, 24, 24] of 64 frequencies, scaled to HEAD_DIM / 2 = 16
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}
    vision_config = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": qwen.TEXT_HIDDEN,
        "mlp_ratio": 2,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": qwen.MERGE_SIZE,
        "temporal_patch_size": qwen.TEMPORAL_PATCH_SIZE,
    }
    return Qwen2VLConfig(
        text_config=qwen.text_config(tokenizer, rope_parameters=rope),
        vision_config=vision_config,
        tie_word_embeddings=False,
        **qwen.vision_token_ids(tokenizer),
    )


def create(*, seed: int):
    """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
    from transformers import Qwen2VLForConditionalGeneration

    processor = build_processor()
    config = build_config(processor.tokenizer)
    return qwen.random_model(Qwen2VLForConditionalGeneration, config, processor.tokenizer, seed=seed), processor


def build(out_dir: Path, *, seed: int) -> None:
    """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
    qwen.save(*create(seed=seed), out_dir)
