"""What the tiny Qwen-VL families (qwen2_vl, qwen2_5_vl, qwen3_vl) share: tokenizer, chat template,
processor layout, text-model shape, generation config.

The three read the same special tokens, so they share one tokenizer (the same ids in each), one
ChatML template and the same processor layout: Qwen2-VL's image processor cuts an image into
`patch_size` px patches and merges them 2x2 into one `<|image_pad|>` token each, so a token covers
`2 * patch_size` px a side (28 for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL). What differs (vision
tower, attention details, rope, the transformers classes) is a `QwenFamily` in each family's module,
which builds it the way this module says.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from vlmrun.models.tiny.tokenizer import TokenizerSpec, chatml_template, train_tokenizer

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

# Qwen2-VL's ChatML; Qwen2.5-VL's and Qwen3-VL-Instruct's render a conversation the same way.
CHAT_TEMPLATE = chatml_template(
    image="<|vision_start|><|image_pad|><|vision_end|>", video="<|vision_start|><|video_pad|><|vision_end|>"
)

MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
TEXT_HIDDEN = 128
HEAD_DIM = 32  # TEXT_HIDDEN / 4 heads
#: How Qwen2-VL and Qwen2.5-VL cut images: 14 px patches; 56x56 up to 448x448 keep their size.
QWEN2_PATCHES = {"patch_size": 14, "min_pixels": 56 * 56, "max_pixels": 448 * 448}
#: Qwen2-VL's and Qwen2.5-VL's rope: their [16, 24, 24] of 64 frequencies, scaled to HEAD_DIM / 2 = 16
QWEN2_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}


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


@dataclass(frozen=True, kw_only=True)
class QwenFamily:
    """One tiny Qwen family: its transformers classes (by name: transformers loads when a model is
    built), how its processor cuts images (`build_processor`), and its config's own parts: `rope`,
    the vision tower's own keys (every tower has 2 blocks of 2 heads and merges 2x2), the text model's
    extra keys (`build_config`). Each build gets copies of them: transformers may change what it is given."""

    processor_class: str
    video_processor_class: str
    config_class: str
    model_class: str
    patch_size: int
    min_pixels: int
    max_pixels: int
    rope: dict
    vision: dict
    text: dict = field(default_factory=dict)
    processor_extra: dict = field(default_factory=dict)

    def build_processor(self):
        """The processor (tokenizer, image and video processors, chat template); deterministic."""
        import transformers

        return build_processor(
            getattr(transformers, self.processor_class),
            getattr(transformers, self.video_processor_class),
            patch_size=self.patch_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            **copy.deepcopy(self.processor_extra),
        )

    def build_config(self, tokenizer):
        """The config: the shared text model with the family's rope and keys, its vision tower, an untied
        head, the placeholder ids."""
        import transformers

        tower = {"depth": 2, "num_heads": 2, "patch_size": self.patch_size, "spatial_merge_size": MERGE_SIZE}
        return getattr(transformers, self.config_class)(
            text_config=text_config(tokenizer, rope_parameters=copy.deepcopy(self.rope), **copy.deepcopy(self.text)),
            vision_config={**tower, "temporal_patch_size": TEMPORAL_PATCH_SIZE, **copy.deepcopy(self.vision)},
            tie_word_embeddings=False,
            **vision_token_ids(tokenizer),
        )

    def create(self, *, seed: int):
        """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
        import transformers

        processor = self.build_processor()
        config = self.build_config(processor.tokenizer)
        model_class = getattr(transformers, self.model_class)
        return random_model(model_class, config, processor.tokenizer, seed=seed), processor

    def build(self, out_dir: Path, *, seed: int) -> None:
        """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
        save(*self.create(seed=seed), out_dir)
