"""Tiny Qwen2-VL: random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen2VLForConditionalGeneration`).
Images are cut as Qwen2.5-VL's (14 px patches merged 2x2: a 112x112 image is 16 `<|image_pad|>`
tokens; 56x56 up to 448x448 keep their size), with the same tokenizer, template and text model
(qwen.py). The vision tower is Qwen2-VL's: LayerNorm, a plain 2-layer MLP (`mlp_ratio`), full
attention in every block; its config calls the tower's width `embed_dim` and the merger's output
(the text model's width) `hidden_size`.
"""

from __future__ import annotations

from vlmrun.models.tiny import qwen

TOKENIZER_SPEC, NEVER_GENERATED, CHAT_TEMPLATE = qwen.TOKENIZER_SPEC, qwen.NEVER_GENERATED, qwen.CHAT_TEMPLATE

FAMILY = qwen.QwenFamily(
    processor_class="Qwen2VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    config_class="Qwen2VLConfig",
    model_class="Qwen2VLForConditionalGeneration",
    **qwen.QWEN2_PATCHES,
    rope=qwen.QWEN2_ROPE,
    # ~0.6M parameters: text hidden 128 x 2 layers, vision width 32 x 2 blocks
    vision={
        "embed_dim": 32,
        "hidden_size": qwen.TEXT_HIDDEN,
        "mlp_ratio": 2,
    },
)
build_processor, build_config, create, build = FAMILY.build_processor, FAMILY.build_config, FAMILY.create, FAMILY.build
