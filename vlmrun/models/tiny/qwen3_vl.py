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

from vlmrun.models.tiny import qwen

TOKENIZER_SPEC, NEVER_GENERATED, CHAT_TEMPLATE = qwen.TOKENIZER_SPEC, qwen.NEVER_GENERATED, qwen.CHAT_TEMPLATE

FAMILY = qwen.QwenFamily(
    processor_class="Qwen3VLProcessor",
    video_processor_class="Qwen3VLVideoProcessor",
    config_class="Qwen3VLConfig",
    model_class="Qwen3VLForConditionalGeneration",
    patch_size=16,
    min_pixels=64 * 64,
    max_pixels=448 * 448,
    processor_extra={"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    # Qwen3-VL's [24, 20, 20] of 64 frequencies, scaled to HEAD_DIM / 2 = 16; transformers 5.24 always
    # interleaves them (T, H, W, T, H, W, ...) for this model, the flag records it as the checkpoints do
    rope={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
    # ~0.6M parameters: text hidden 128 x 2 layers, vision hidden 32 x 2 blocks, one DeepStack level
    vision={
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": qwen.TEXT_HIDDEN,
        "num_position_embeddings": 16 * 16,  # a square grid, bilinearly resampled to each image's patches
        "deepstack_visual_indexes": [0],  # must be fewer than the text layers: one is added after each
    },
    text={"head_dim": qwen.HEAD_DIM},
)
build_processor, build_config, create, build = FAMILY.build_processor, FAMILY.build_config, FAMILY.create, FAMILY.build
