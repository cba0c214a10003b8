"""Parameter counts and layer shapes of a VLM, read from its Hugging Face config.json alone.

Counted analytically (no torch, no transformers: `vlmrun submit --dry-run` stays fast on a login
node) for the module tree transformers 5.24 builds for each family: Qwen2-VL, Qwen2.5-VL and Qwen3-VL
(vision tower, merger, Qwen2 / Qwen3 decoder; Qwen3-VL adds a learned position grid and the DeepStack
mergers) and Nemotron-Omni (RADIO vision tower, projector, NemotronH hybrid Mamba/attention/MoE
decoder with every routed expert, the optional Parakeet audio tower). Both the current key names
(`text_config`, `audio_config`, `layers_block_type`) and the released checkpoints' older ones
(`llm_config`, `sound_config`, `hybrid_override_pattern`, `vit_hidden_size`, text fields at the top
level) are read. tests/test_fit_check.py checks every count against meta-device instantiation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class UnknownArchitecture(ValueError):
    """The config lacks what the count needs (e.g. an empty config.json) or has a layout this does not know."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """One layer: its parameters and the widths (elements per token) its activations scale with.

    `attn_width`: q + k + v outputs; `ffn_width`: the intermediates a token passes through (top-k
    experts plus the shared one, for MoE); `scan_width`: Mamba's in_proj output plus its per-token
    chunked-scan terms; `kv_width`: the KV cache per token; `state_elems`: Mamba's recurrent and
    convolution state per sequence.
    """

    kind: str
    params: int
    hidden: int
    attn_width: int = 0
    ffn_width: int = 0
    gated: bool = False
    experts_per_token: int = 0
    scan_width: int = 0
    kv_width: int = 0
    state_elems: int = 0


@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """The vision encoder: its blocks, the patch side in pixels and how patches merge into tokens."""

    params: int
    block: Block
    depth: int
    patch_size: int
    extra_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the memory estimate needs to know about a model (see models/memory.py)."""

    family: str
    components: dict[str, int]
    layers: tuple[Block, ...]
    hidden: int
    vocab: int
    vision: VisionTower
    heads: int = 0  # attention heads of the language model (0: not counted for this family)
    kv_heads: int = 0  # its key/value heads (query groups)
    tied: bool = False  # the head is the embedding

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, head, norms, vision and audio towers."""
        return self.total - sum(b.params for b in self.layers)

    @property
    def largest_layer(self) -> int:
        return max(b.params for b in self.layers)


def count_architecture(family: str, config: dict) -> Architecture:
    """The `Architecture` of a `family` model from its config.json contents.

    Raises UnknownArchitecture when the config lacks the keys the family needs.
    """
    counters = {
        "qwen2_vl": _qwen2_vl,
        "qwen2_5_vl": _qwen2_5_vl,
        "qwen3_vl": _qwen3_vl,
        "nemotron_omni": _nemotron_omni,
    }
    if family not in counters:
        raise UnknownArchitecture(f"no parameter count for family {family!r}")
    try:
        return counters[family](config)
    except (KeyError, TypeError) as e:
        raise UnknownArchitecture(f"the config has no {e} for a {family} model") from None


def _linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _head(text: dict, tied: bool) -> tuple[int, int]:
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    return vocab * hidden * (1 if tied else 2), vocab


# ---------------------------------------------------------------- Qwen2-VL, Qwen2.5-VL, Qwen3-VL


def _qwen2_vl(config: dict) -> Architecture:
    text = config.get("text_config") or config
    layer = _qwen_decoder(text, text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"], kv=8)
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return _qwen_architecture("qwen2_vl", text, layer, tied, _qwen2_vision(config["vision_config"]))


def _qwen2_5_vl(config: dict) -> Architecture:
    text = config.get("text_config") or config
    layer = _qwen_decoder(text, text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"], kv=8)
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return _qwen_architecture("qwen2_5_vl", text, layer, tied, _qwen_vision(config["vision_config"]))


def _qwen3_vl(config: dict) -> Architecture:
    """Qwen3's decoder: q/k RMSNorm over the head, `attention_bias` (default none) on all four
    projections, head_dim 128 and 32 key/value heads unless set; only the top-level
    `tie_word_embeddings` ties (transformers 5.24 does not read text_config's for this family)."""
    text = config["text_config"]
    bias = text.get("attention_bias", False)
    layer = _qwen_decoder(text, text.get("head_dim", 128), kv=32, qkv_bias=bias, o_bias=bias, qk_norm=True)
    tied = bool(config.get("tie_word_embeddings", False))
    return _qwen_architecture("qwen3_vl", text, layer, tied, _qwen3_vision(config["vision_config"]))


def _qwen_decoder(
    text: dict, head_dim: int, *, kv: int, qkv_bias: bool = True, o_bias: bool = False, qk_norm: bool = False
) -> Block:
    """`kv`: the config class's default for `num_key_value_heads` (None there means one per query head)."""
    h, heads = text["hidden_size"], text["num_attention_heads"]
    kv = text.get("num_key_value_heads", kv) or heads
    q_out, kv_out, ffn = heads * head_dim, kv * head_dim, text["intermediate_size"]
    attn = _linear(h, q_out, qkv_bias) + 2 * _linear(h, kv_out, qkv_bias) + _linear(q_out, h, o_bias)
    return Block(
        kind="decoder",
        params=attn + (2 * head_dim if qk_norm else 0) + 3 * _linear(h, ffn) + 2 * h,
        hidden=h,
        attn_width=q_out + 2 * kv_out,
        ffn_width=ffn,
        gated=True,
        kv_width=2 * kv_out,
    )


def _qwen_architecture(family: str, text: dict, layer: Block, tied: bool, vision: VisionTower) -> Architecture:
    layers = (layer,) * text["num_hidden_layers"]
    embed, vocab = _head(text, tied)
    lm = embed + sum(b.params for b in layers) + text["hidden_size"]
    heads = text["num_attention_heads"]
    return Architecture(
        family=family,
        components={"language_model": lm, "vision": vision.params},
        layers=layers,
        hidden=text["hidden_size"],
        vocab=vocab,
        vision=vision,
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        tied=tied,
    )


def _qwen_vision(v: dict) -> VisionTower:
    """Qwen2.5-VL's tower: RMSNorm, gated MLP."""
    h, ffn = v.get("hidden_size", 3584), v.get("intermediate_size", 3420)
    block = Block(
        kind="vision",
        params=2 * h
        + _linear(h, 3 * h, True)
        + _linear(h, h, True)
        + 2 * _linear(h, ffn, True)
        + _linear(ffn, h, True),
        hidden=h,
        attn_width=3 * h,
        ffn_width=ffn,
        gated=True,
    )
    merger = h + _merger(h, v, v.get("out_hidden_size", 3584))
    return _qwen_tower(v, h, block, merger, default_patch=14)


def _qwen2_vision(v: dict) -> VisionTower:
    """Qwen2-VL's tower: `embed_dim` wide, LayerNorm, a plain MLP; `hidden_size` is the merger's output."""
    e = v.get("embed_dim", 1280)
    block = _layernorm_vision_block(e, int(e * v.get("mlp_ratio", 4)))
    merger = 2 * e + _merger(e, v, v.get("hidden_size", 3584))
    return _qwen_tower(v, e, block, merger, default_patch=14)


def _qwen3_vision(v: dict) -> VisionTower:
    """Qwen3-VL's tower: LayerNorm, a plain MLP, a patch embedding with bias, a learned position grid,
    and one merger (LayerNorm after the 2x2 shuffle) per DeepStack level."""
    h, out = v.get("hidden_size", 1152), v.get("out_hidden_size", 3584)
    block = _layernorm_vision_block(h, v.get("intermediate_size", 4304))
    merged = h * v.get("spatial_merge_size", 2) ** 2
    levels = len(v.get("deepstack_visual_indexes", (8, 16, 24)))
    extra = h + v.get("num_position_embeddings", 2304) * h  # patch-embedding bias, position grid
    merger = 2 * h + _merger(h, v, out) + levels * (2 * merged + _merger(h, v, out))
    return _qwen_tower(v, h, block, extra + merger, default_patch=16, default_depth=27)


def _layernorm_vision_block(h: int, ffn: int) -> Block:
    params = 4 * h + _linear(h, 3 * h, True) + _linear(h, h, True) + _linear(h, ffn, True) + _linear(ffn, h, True)
    return Block(kind="vision", params=params, hidden=h, attn_width=3 * h, ffn_width=ffn)


def _merger(h: int, v: dict, out: int) -> int:
    """The two linear layers of a patch merger (2x2 neighbours concatenated, then projected to `out`)."""
    merged = h * v.get("spatial_merge_size", 2) ** 2
    return _linear(merged, merged, True) + _linear(merged, out, True)


def _qwen_tower(
    v: dict, h: int, block: Block, rest: int, *, default_patch: int, default_depth: int = 32
) -> VisionTower:
    """`rest`: every parameter besides the blocks and the patch embedding's kernel."""
    depth, patch = v.get("depth", default_depth), v.get("patch_size", default_patch)
    channels = v.get("in_channels", v.get("in_chans", 3))
    patch_embed = h * channels * v.get("temporal_patch_size", 2) * patch * patch
    return VisionTower(params=patch_embed + depth * block.params + rest, block=block, depth=depth, patch_size=patch)


# ---------------------------------------------------------------- Nemotron-Omni

_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_LEGACY_KIND = {"mamba": "linear_attention", "attention": "full_attention"}


def _layer_kinds(text: dict) -> list[str]:
    if text.get("layers_block_type"):
        return [_LEGACY_KIND.get(k, k) for k in text["layers_block_type"]]
    return [_PATTERN[c] for c in text["hybrid_override_pattern"]]


def _nemotron_omni(config: dict) -> Architecture:
    text = config.get("text_config") or config.get("llm_config")
    if not text:
        raise UnknownArchitecture("the config has no text_config (or llm_config)")
    if text.get("moe_latent_size") is not None:
        raise UnknownArchitecture("moe_latent_size (latent MoE projections) is not counted")
    h = text["hidden_size"]
    build = {"linear_attention": _mamba, "full_attention": _attention, "moe": _moe, "mlp": _mlp}
    layers = tuple(build[kind](text) for kind in _layer_kinds(text))
    embed, vocab = _head(text, bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    lm = embed + sum(b.params for b in layers) + h
    vision = _radio(config.get("vision_config") or {})
    vision_hidden = config.get("vision_hidden_size", config.get("vit_hidden_size", 1280))
    projector_in = vision_hidden * int(1 / config.get("downsample_ratio", 0.5)) ** 2
    projector = (
        projector_in
        + _linear(projector_in, config.get("projector_hidden_size", 4096))
        + _linear(config.get("projector_hidden_size", 4096), h)
    )
    if text.get("num_nextn_predict_layers", 0) > 0:  # transformers adds a final LayerNorm to the vision tower
        projector += 2 * vision_hidden
    components = {"language_model": lm, "vision": vision.params, "projector": projector}
    audio = config.get("audio_config", config.get("sound_config"))
    if audio:
        components["audio"] = _parakeet(audio, h)
    return Architecture(
        family="nemotron_omni", components=components, layers=layers, hidden=h, vocab=vocab, vision=vision
    )


def _mamba(t: dict) -> Block:
    h, heads, head_dim = t["hidden_size"], t["mamba_num_heads"], t["mamba_head_dim"]
    inner, groups_state = heads * head_dim, 2 * t.get("n_groups", 8) * t.get("ssm_state_size", 128)
    conv_dim, kernel, bias = inner + groups_state, t.get("conv_kernel", 4), t.get("use_bias", False)
    proj = inner + conv_dim + heads
    conv = conv_dim * kernel + (conv_dim if t.get("use_conv_bias", True) else 0)
    params = h + _linear(h, proj, bias) + conv + 3 * heads + inner + _linear(inner, h, bias)
    chunk = t.get("chunk_size", 128)
    state = heads * head_dim * t.get("ssm_state_size", 128) + conv_dim * kernel
    return Block(kind="mamba", params=params, hidden=h, scan_width=proj + conv_dim + heads * chunk, state_elems=state)


def _attention(t: dict) -> Block:
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t.get("num_key_value_heads", 8)
    head_dim = t.get("head_dim") or h // heads
    params = h + 2 * _linear(h, heads * head_dim) + 2 * _linear(h, kv * head_dim)
    return Block(
        kind="attention",
        params=params,
        hidden=h,
        attn_width=(heads + 2 * kv) * head_dim,
        kv_width=2 * kv * head_dim,
    )


def _moe(t: dict) -> Block:
    h, experts, width = t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"]
    shared, bias = t.get("moe_shared_expert_intermediate_size", 7688), t.get("mlp_bias", False)
    top_k = t.get("num_experts_per_tok", 2)
    params = h + experts * h + experts * 2 * h * width + _linear(h, shared, bias) + _linear(shared, h, bias)
    return Block(kind="moe", params=params, hidden=h, ffn_width=top_k * width + shared, experts_per_token=top_k)


def _mlp(t: dict) -> Block:
    h, width, bias = t["hidden_size"], t.get("intermediate_size", 21504), t.get("mlp_bias", False)
    return Block(kind="mlp", params=h + _linear(h, width, bias) + _linear(width, h, bias), hidden=h, ffn_width=width)


def _radio(v: dict) -> VisionTower:
    h, depth, patch = v.get("hidden_size", 1280), v.get("num_hidden_layers", 32), v.get("patch_size", 16)
    patch_dim = v.get("num_channels", 3) * patch * patch
    ffn = int(h * v.get("mlp_ratio", 4.0))
    if v.get("use_swiglu_ffn", False):
        ffn = (int(ffn * 2 / 3) + 7) // 8 * 8
        mlp = 2 * _linear(h, ffn, True) + _linear(ffn, h, True)
    else:
        mlp = _linear(h, ffn, True) + _linear(ffn, h, True)
    attn = 3 * _linear(h, h, v.get("qkv_bias", True)) + _linear(h, h, True)
    block = Block(
        kind="vision",
        params=4 * h + attn + 2 * h + mlp,
        hidden=h,
        attn_width=3 * h,
        ffn_width=ffn,
        gated=v.get("use_swiglu_ffn", False),
    )
    tokens = v.get("num_cls_tokens", 3) + v.get("num_registers", 7)
    video = v.get("video_temporal_patch_size")
    embed = patch_dim * h + (video * patch_dim * h if video else 0) + tokens * h
    embed += (v.get("max_img_size", 2048) // patch) ** 2 * h
    return VisionTower(
        params=embed + depth * block.params, block=block, depth=depth, patch_size=patch, extra_tokens=tokens
    )


def _parakeet(a: dict, text_hidden: int) -> int:
    """Parakeet (FastConformer) encoder plus the projector into the language model. The Omni config
    defaults `attention_bias` to False for configs that lack it (the released checkpoints)."""
    h, ffn, k = a.get("hidden_size", 1024), a.get("intermediate_size", 4096), a.get("conv_kernel_size", 9)
    bias, conv_bias = a.get("attention_bias", False), a.get("convolution_bias", True)
    heads = a.get("num_attention_heads", 8)
    feed_forward = _linear(h, ffn, bias) + _linear(ffn, h, bias)
    attention = 4 * _linear(h, h, bias) + h * h + 2 * heads * (h // heads)
    conv = _linear(h, 2 * h, conv_bias) + h * k + (h if conv_bias else 0) + 2 * h + _linear(h, h, conv_bias)
    layer = 2 * feed_forward + attention + conv + 5 * 2 * h
    channels, kernel = a.get("subsampling_conv_channels", 256), a.get("subsampling_conv_kernel_size", 3)
    stride, steps = a.get("subsampling_conv_stride", 2), int(math.log2(a.get("subsampling_factor", 8)))
    sub = channels * kernel * kernel + channels
    sub += (steps - 1) * (channels * kernel * kernel + channels + channels * channels + channels)
    sub += _linear(channels * (a.get("num_mel_bins", 80) // stride**steps), h, True)
    proj_hidden, proj_bias = a.get("projection_hidden_size", 4096), a.get("projection_bias", False)
    projector = h + _linear(h, proj_hidden, proj_bias) + _linear(proj_hidden, text_hidden, proj_bias)
    return sub + a.get("num_hidden_layers", 24) * layer + projector
