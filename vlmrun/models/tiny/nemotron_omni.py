"""Tiny Nemotron Nano Omni: RADIO vision + NemotronH hybrid Mamba/attention/MoE text model.

Loads back with `AutoProcessor` and `AutoModelForImageTextToText` (-> `NemotronH_Omni_Reasoning_V3`).
Images are cut into 16 px patches (the side rounded up to an even patch count) and pixel-shuffled 2x2:
a 112x112 image becomes an 8x8 grid (resized to 128x128) and 16 `<image>` tokens, 64x64 gives 4,
224x224 gives 49, 448x448 gives 196; bigger images are scaled down to at most 784 patches.
No audio tower (`audio_config=None`); the processor still carries the family's audio feature extractor.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.models.tiny.tokenizer import TokenizerSpec, chatml_template, train_tokenizer

TOKENIZER_SPEC = TokenizerSpec(
    special_tokens=(
        "<unk>",
        "<pad>",
        "<|im_start|>",
        "<|im_end|>",
        "<image>",
        "<img>",
        "</img>",
        "<video>",
        "<so_embedding>",
        "<so_start>",
        "<so_end>",
    ),
    added_tokens=("<think>", "</think>"),
    eos_token="<|im_end|>",
    pad_token="<pad>",
    unk_token="<unk>",
)
# an emitted placeholder would break the forward pass that re-reads the response (see __init__): every
# special token but the end of a turn
NEVER_GENERATED = tuple(t for t in TOKENIZER_SPEC.special_tokens if t != TOKENIZER_SPEC.eos_token)

# Nemotron 3's ChatML in no-thinking mode: the assistant turn opens with an empty <think></think>,
# which belongs to the prompt. The processor expands each `<image>` into `<img>` + one `<image>` per
# vision token + `</img>`.
CHAT_TEMPLATE = chatml_template(image="<image>\\n", video="<video>\\n", think="<think></think>")

PATCH_SIZE = 16
MAX_NUM_PATCHES = 28 * 28  # a 448x448 image


def build_processor():
    """The processor (tokenizer, image and video processors, chat template); deterministic."""
    from transformers import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
        NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
        ParakeetFeatureExtractor,
    )

    tokenizer = train_tokenizer(TOKENIZER_SPEC)
    tokenizer.chat_template = CHAT_TEMPLATE
    # the defaults upscale every image to >= 1024 patches; a tiny model wants the image's own size
    image_processor = NemotronH_Omni_Reasoning_V3ImageProcessor(
        patch_size=PATCH_SIZE,
        downsample_ratio=0.5,
        min_num_patches=4,
        max_num_patches=MAX_NUM_PATCHES,
        max_model_len=4096,
    )
    video_processor = NemotronH_Omni_Reasoning_V3VideoProcessor(
        patch_size=PATCH_SIZE, downsample_ratio=0.5, video_target_num_patches=64, temporal_patch_size=2
    )
    return NemotronH_Omni_Reasoning_V3Processor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tokenizer,
        # required by the processor's signature even though the tiny model has no audio tower
        feature_extractor=ParakeetFeatureExtractor(sampling_rate=16000),
        chat_template=CHAT_TEMPLATE,
        video_temporal_patch_dim=2,
    )


def build_config(tokenizer):
    """Config of ~0.25M parameters: one Mamba, one attention and one MoE layer; RADIO hidden 32 x 2."""
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    ids = tokenizer.convert_tokens_to_ids
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "layers_block_type": ["linear_attention", "full_attention", "moe"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": ids("<pad>"),
        "bos_token_id": ids("<|im_start|>"),
        "eos_token_id": ids("<|im_end|>"),
    }
    vision_config = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": PATCH_SIZE,
        "image_size": 64,
        "max_img_size": 256,
        "num_cls_tokens": 1,
        "num_registers": 1,
        # the default [0, 1] reads a second cls token, which a 1-cls tower does not have
        "summary_idxs": [0],
        "video_temporal_patch_size": 2,
    }
    return NemotronH_Omni_Reasoning_V3_Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        force_image_size=64,
        downsample_ratio=0.5,
        projector_hidden_size=64,
        vision_hidden_size=32,
        video_temporal_patch_size=2,
        image_token_id=ids("<image>"),
        video_token_id=ids("<video>"),
        audio_token_id=ids("<so_embedding>"),
        tie_word_embeddings=False,
    )


def create(*, seed: int):
    """`(model, processor)` in memory; the model is random-init from `seed`, the global RNG is left alone."""
    import torch
    from transformers import GenerationConfig, NemotronH_Omni_Reasoning_V3

    processor = build_processor()
    tokenizer = processor.tokenizer
    config = build_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NemotronH_Omni_Reasoning_V3(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        suppress_tokens=tokenizer.convert_tokens_to_ids(list(NEVER_GENERATED)),
        do_sample=False,
    )
    return model, processor


def build(out_dir: Path, *, seed: int) -> None:
    """Write model, processor and generation config of `create(seed=seed)` into `out_dir`."""
    model, processor = create(seed=seed)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
