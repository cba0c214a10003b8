"""What the tiny Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl) share: tokenizer, chat template,
processor layout, text-model shape, generation config.

The three read the same special tokens, so they share one tokenizer (the same ids in each), one
ChatML template and the same processor layout: Qwen2-VL's image processor cuts an image into
`patch_size` px patches and merges them 2x2 into one `<|image_pad|>` token each, so a token covers
`2 * patch_size` px a side (28 for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL). What differs (vision
tower, attention details, rope) is in each family's module.
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
# length); Qwen2.5-VL's and Qwen3-VL-Instruct's render a conversation the same way. The assistant
# turn, <|im_end|> included, is inside {% generation %} for assistant masks.
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

MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
TEXT_HIDDEN = 128
HEAD_DIM = 32  # TEXT_HIDDEN / 4 heads


def build_processor(
    processor_class, video_processor_class, *, patch_size: int, min_pixels: int, max_pixels: int, **extra
):
    """A `processor_class` over the shared tokenizer and template, Qwen2-VL's image processor and
    `video_processor_class`, both cutting `patch_size` px patches; images between `min_pixels` and
    `max_pixels` keep their size (rounded to whole merged tokens). `extra`: more image and video
    processor settings (e.g. normalization). Deterministic."""
    from transformers import Qwen2VLImageProcessor

    tokenizer = train_tokenizer(TOKENIZER_SPEC)
    tokenizer.chat_template = CHAT_TEMPLATE
    settings = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        **extra,
    }
    return processor_class(
        image_processor=Qwen2VLImageProcessor(**settings),
        tokenizer=tokenizer,
        video_processor=video_processor_class(**settings),
        chat_template=CHAT_TEMPLATE,
    )


def text_config(tokenizer, *, rope_parameters: dict, **extra) -> dict:
    """The text model every tiny Qwen family has: hidden 128 x 2 layers, 4 query and 2 key/value heads
    of HEAD_DIM. `rope_parameters` must split HEAD_DIM / 2 rotary frequencies over (time, height, width)
    in its `mrope_section`; `extra`: the family's own keys."""
    if sum(rope_parameters["mrope_section"]) != HEAD_DIM // 2:
        raise ValueError(f"mrope_section {rope_parameters['mrope_section']} must sum to {HEAD_DIM // 2}")
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": TEXT_HIDDEN // HEAD_DIM,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": rope_parameters,
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
        **extra,
    }


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The placeholder and delimiter ids a Qwen-VL config names."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def random_model(model_class, config, tokenizer, *, seed: int):
    """`model_class(config)` random-init from `seed` (the global RNG is left alone), with the generation
    config that suppresses placeholder and role tokens and stops at <|im_end|> or <|endoftext|>."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        suppress_tokens=tokenizer.convert_tokens_to_ids(list(NEVER_GENERATED)),
        do_sample=False,
    )
    return model


def save(model, processor, out_dir: Path) -> None:
    """Write model, processor and generation config into `out_dir`."""
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
