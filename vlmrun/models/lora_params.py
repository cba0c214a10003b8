"""How many parameters a recipe's LoRA adapters add to a model (`model.lora`), from its architecture.

Pure arithmetic over `params.Architecture` (no torch), for the memory-fit check at submit: with LoRA only
the adapters have gradients and optimizer state. An adapter on a linear layer in -> out holds
rank x (in + out) parameters. What each named set reaches follows policy/lora.py; a layer's projections
are told apart by the widths the architecture records, so the count is an estimate, close for dense models.
"""

from __future__ import annotations

from vlmrun.models.params import Architecture, Block


def adapter_params(arch: Architecture, lora) -> int:
    """The adapters' parameters of `lora` (the recipe's model.lora) on `arch`, all ranks together."""
    r = lora.rank
    total = sum(_decoder_layer(b, lora.targets) for b in arch.layers)
    if lora.vision:
        total += arch.vision.depth * _vision_block(arch.vision.block)
    if lora.projector:  # two linear layers of about the tower's width to the language model's
        total += 2 * (arch.vision.block.hidden * 4 + arch.hidden)
    return r * total


def _decoder_layer(b: Block, targets: str) -> int:
    """in + out summed over the layer's linear layers that `targets` reaches (x rank: its adapters)."""
    h = b.hidden
    attention = 0
    if b.attn_width:  # q, k, v (their outputs are attn_width together; k and v are kv_width) and o
        q = b.attn_width - b.kv_width
        attention = 3 * h + b.attn_width + q + h
    shared = b.ffn_width if not b.experts_per_token else 0  # routed experts are fused: no adapter reaches them
    mlp = (3 if b.gated else 2) * (h + shared)
    scan = 2 * h + b.scan_width if b.kind == "mamba" else 0  # in_proj and out_proj, over-counted a little
    return {"attention": attention, "mlp": mlp}.get(targets, attention + mlp + scan)


def _vision_block(b: Block) -> int:
    """in + out of a tower block's linear layers: the fused qkv, the output projection, its MLP."""
    h = b.hidden
    return h + b.attn_width + 2 * h + (3 if b.gated else 2) * (h + b.ffn_width)
