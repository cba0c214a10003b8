"""Tiny Qwen3-VL (dense): random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen3VLForConditionalGeneration`).
Same tokenizer, template and text width as the other Qwen families (qwen.py), but 16 px patches merged
2x2, so a token covers 32x32 px: a 112x112 image is rounded to 128x128 (8x8 patches, 16
`<|image_pad|>` tokens), 64 gives 4, 224 gives 49, 448 gives 196; 64x64 up to 448x448 keep their
size. What Qwen3-VL adds: q/k RMSNorm and no q/k/v bias in the text attention, interleaved mrope, a
learned position grid in the vision tower (`num_position_embeddings`, resampled to each image) and
DeepStack: the output of each block in `deepstack_visual_indexes` gets a merger of its own and is
added to the image tokens' hidden states after text layer 0, 1, ... in order. Images are normalized
to [-1, 1] (mean and std 0.5), as Qwen3-VL's published processor does.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.models.tiny import qwen

TOKENIZER_SPEC = qwen.TOKENIZER_SPEC
NEVER_GENERATED = qwen.NEVER_GENERATED
CHAT_TEMPLATE = qwen.CHAT_TEMPLATE

PATCH_SIZE = 16
MIN_PIXELS = 64 * 64
MAX_PIXELS = 448 * 448
NORMALIZE = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def build_processor():
    """The processor (tokenizer, image and video processors, chat template); deterministic."""
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    return qwen.build_processor(
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
        patch_size=PATCH_SIZE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        **NORMALIZE,
    )


def build_config(tokenizer):
    """Config of ~0.6M parameters: text hidden 128 x 2 layers, vision hidden 32 x 2 blocks, one DeepStack level."""
    from transformers import Qwen3VLConfig

    # Qwen3-VL's [24, 20, 20] of 64 frequencies, scaled to HEAD_DIM / 2 = 16; transformers 5.24 always
    # interleaves them (T, H, W, T, H, W, ...) for this model, the flag records it as the checkpoints do
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": qwen.MERGE_SIZE,
        "temporal_patch_size": qwen.TEMPORAL_PATCH_SIZE,
        "out_hidden_size": qwen.TEXT_HIDDEN,
        "num_position_embeddings": 16 * 16,  # a square grid, bilinearly resampled to each image's patches
        "deepstack_visual_indexes": [0],  # must be fewer than the text layers: one is added after each
    }
    return Qwen3VLConfig(
        text_config=qwen.text_config(tokenizer, rope_parameters=rope, head_dim=qwen.HEAD_DIM),
        vision_config=vision_config,
        tie_word_embeddings=False,
        **qwen.vision_token_ids(tokenizer),
    )


def create(*, seed: int):
    """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
    from transformers import Qwen3VLForConditionalGeneration

    processor = build_processor()
    config = build_config(processor.tokenizer)
    return qwen.random_model(Qwen3VLForConditionalGeneration, config, processor.tokenizer, seed=seed), processor


def build(out_dir: Path, *, seed: int) -> None:
    """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
    qwen.save(*create(seed=seed), out_dir)
