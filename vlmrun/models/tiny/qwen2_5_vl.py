"""Tiny Qwen2.5-VL: random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen2_5_VLForConditionalGeneration`).
A 112x112 image is 8x8 patches of 14 px, merged 2x2 into 16 `<|image_pad|>` tokens; images from
56x56 up to 448x448 (multiples of 28) keep their size, bigger ones are scaled down to 448*448 pixels.
Tokenizer, template and processor layout are the Qwen families' (qwen.py); the vision tower is
Qwen2.5-VL's: RMSNorm, gated MLP, windowed attention with full attention in `fullatt_block_indexes`.
"""

from __future__ import annotations

from vlmrun.models.tiny import qwen

TOKENIZER_SPEC, NEVER_GENERATED, CHAT_TEMPLATE = qwen.TOKENIZER_SPEC, qwen.NEVER_GENERATED, qwen.CHAT_TEMPLATE

FAMILY = qwen.QwenFamily(
    processor_class="Qwen2_5_VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    config_class="Qwen2_5_VLConfig",
    model_class="Qwen2_5_VLForConditionalGeneration",
    **qwen.QWEN2_PATCHES,
    rope=qwen.QWEN2_ROPE,
    # ~0.6M parameters: text hidden 128 x 2 layers, vision hidden 32 x 2 blocks
    vision={
        "hidden_size": 32,
        "intermediate_size": 64,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": qwen.TEXT_HIDDEN,
    },
    text={"max_window_layers": 2},
)
build_processor, build_config, create, build = FAMILY.build_processor, FAMILY.build_config, FAMILY.create, FAMILY.build
