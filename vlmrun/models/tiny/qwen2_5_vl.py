"""Tiny Qwen2.5-VL: random weights from a config, offline tokenizer, the standard processor.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `Qwen2_5_VLForConditionalGeneration`).
A 112x112 image is 8x8 patches of 14 px, merged 2x2 into 16 `<|image_pad|>` tokens; images from
56x56 up to 448x448 (multiples of 28) keep their size, bigger ones are scaled down to 448*448 pixels.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.models.tiny.tokenizer import TokenizerSpec, train_tokenizer

TOKENIZER_SPEC = TokenizerSpec(
    special_tokens=(
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
)
# an emitted placeholder would break the forward pass that re-reads the response (see __init__)
NEVER_GENERATED = ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's ChatML template without the default system prompt (it would double a tiny sample's
# length). The assistant turn, <|im_end|> included, is inside {% generation %} for assistant masks.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\\n' -}}
  {%- if message['role'] == 'assistant' -%}
    {%- generation -%}
      {%- if message['content'] is string -%}{{- message['content'] -}}
      {%- else -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}
      {%- endif -%}
      {{- '<|im_end|>' -}}
    {%- endgeneration -%}
    {{- '\\n' -}}
  {%- else -%}
    {%- if message['content'] is string -%}{{- message['content'] -}}
    {%- else -%}
      {%- for part in message['content'] -%}
        {%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
        {%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
        {%- elif part['type'] == 'text' -%}{{- part['text'] -}}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448


def build_processor():
    """The processor (tokenizer, image and video processors, chat template); deterministic."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = train_tokenizer(TOKENIZER_SPEC)
    tokenizer.chat_template = CHAT_TEMPLATE
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(
        size=size, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2
    )
    video_processor = Qwen2VLVideoProcessor(
        size=size, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2
    )
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer):
    """Config of ~0.6M parameters: text hidden 128 x 2 layers, vision hidden 32 x 2 blocks."""
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    head_dim = 32
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        # mrope splits head_dim / 2 rotary frequencies over (time, height, width)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    assert 128 // 4 == head_dim and sum(text_config["rope_parameters"]["mrope_section"]) == head_dim // 2
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 128,
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def create(*, seed: int):
    """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    processor = build_processor()
    tokenizer = processor.tokenizer
    config = build_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        suppress_tokens=tokenizer.convert_tokens_to_ids(list(NEVER_GENERATED)),
        do_sample=False,
    )
    return model, processor


def build(out_dir: Path, *, seed: int) -> None:
    """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
    model, processor = create(seed=seed)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
