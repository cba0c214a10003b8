"""Our HF <-> megatron-core mapping of Qwen2-VL and Qwen2.5-VL, both directions, for any tp x pp layout.

Torch only (no megatron import): the load, the checkpoint's pieces, the refit and the export all go
through `stage_params`, and tests check its round trips in-process.

1. Names. A pipeline stage's module (model.py `VisionLanguageStage`) holds `visual.*` (the HF vision
   tower, first stage only: HF `model.visual.*`) and `lm.*` (megatron's GPTModel): embedding on the
   first stage, decoder layers `lm.decoder.layers.<j>` for the global layers `first + j`, final norm
   and output layer on the last. HF names are transformers' in-memory names (`model.language_model.*`,
   `model.visual.*`, `lm_head.weight`): the hf backend's state_dict keys, which the refit, the
   checkpoint and the export speak.
2. Tensor parallelism. Every megatron parameter holds the tensor-parallel piece of one or more HF
   tensors, each piece the `tp_rank`-th of `tp` equal chunks of the HF tensor along `split` (0: column
   parallel and the vocabulary; 1: row parallel; None: replicated: norms, the vision tower):
   - `plain`: one HF tensor, the piece itself (embedding, output layer, o_proj, down_proj, norms).
   - `qkv`: q, k and v fused group-major: per query group of this rank, its q heads, then its k head,
     then its v head (bias the same way). A rank's groups are whole and consecutive, so each of q, k
     and v contributes a dim-0 chunk.
   - `gate_up`: fc1 is this rank's gate chunk, then its up chunk.
   A tied head (`tie_word_embeddings`) is built untied, as megatron-core builds it across pipeline
   stages: the output layer is a `copy` of the embedding, their gradients summed before every step
   (grads.py), so both take the same update; the copy is never saved, exported or refit.
3. A piece of an HF tensor is the same whichever layout holds it, so `ParamMap.to_hf` (a megatron
   parameter, or any tensor shaped like it: an Adam moment, a gradient, into its HF pieces) and
   `ParamMap.from_hf` (pieces into the megatron layout) are all the load, the checkpoint and the
   refit need; `whole`/`piece` join and cut along `split`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

LM = "model.language_model."
VISUAL = "model.visual."
HEAD = "lm_head.weight"


@dataclass(frozen=True, kw_only=True)
class LmShape:
    """The language model's dimensions, from an HF config's text part."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> LmShape:
        """From a transformers Qwen2-VL / Qwen2.5-VL config (its `text_config`)."""
        text = getattr(config, "text_config", config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        tied = bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        return cls(
            layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            ffn=text.intermediate_size,
            vocab=text.vocab_size,
            tied=tied,
        )

    @property
    def q_per_group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True, kw_only=True)
class ParamMap:
    """One megatron parameter of a stage and the HF tensors it holds pieces of, and how (`kind`, `split`)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Literal["plain", "qkv", "gate_up"] = "plain"
    split: int | None = None
    q_per_group: int = 1
    head_dim: int = 1
    copy: bool = False  # a tied output layer: the embedding's copy (grads.py sums their gradients)

    def to_hf(self, local: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF pieces `local` (this parameter's layout) holds, by HF name; views where they can be."""
        if self.kind == "plain":
            return {self.hf[0]: local}
        if self.kind == "gate_up":
            gate, up = local.chunk(2, dim=0)
            return {self.hf[0]: gate, self.hf[1]: up}
        rest = local.shape[1:]
        per_group = (self.q_per_group + 2) * self.head_dim
        groups = local.reshape(-1, per_group, *rest)
        q_rows = self.q_per_group * self.head_dim
        q = groups[:, :q_rows].reshape(-1, *rest)
        k = groups[:, q_rows : q_rows + self.head_dim].reshape(-1, *rest)
        v = groups[:, q_rows + self.head_dim :].reshape(-1, *rest)
        return {self.hf[0]: q, self.hf[1]: k, self.hf[2]: v}

    def from_hf(self, pieces: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This parameter's layout of its HF pieces (`to_hf`'s inverse)."""
        if self.kind == "plain":
            return pieces[self.hf[0]]
        if self.kind == "gate_up":
            return torch.cat([pieces[self.hf[0]], pieces[self.hf[1]]], dim=0)
        q, k, v = (pieces[n] for n in self.hf)
        rest = q.shape[1:]
        groups = k.shape[0] // self.head_dim
        fused = torch.cat(
            [
                q.reshape(groups, self.q_per_group * self.head_dim, *rest),
                k.reshape(groups, self.head_dim, *rest),
                v.reshape(groups, self.head_dim, *rest),
            ],
            dim=1,
        )
        return fused.reshape(-1, *rest)


def piece(whole_tensor: torch.Tensor, split: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """The `tp_rank`-th of `tp` equal chunks of an HF tensor along `split` (itself when replicated)."""
    if split is None or tp == 1:
        return whole_tensor
    size = whole_tensor.shape[split]
    if size % tp:
        raise ValueError(f"dimension {split} of size {size} does not split into {tp} equal pieces")
    return whole_tensor.narrow(split, tp_rank * (size // tp), size // tp)


def whole(pieces: list[torch.Tensor], split: int | None) -> torch.Tensor:
    """An HF tensor from its pieces in tensor-parallel rank order (`piece`'s inverse)."""
    if split is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=split)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Which part of the model a pipeline stage holds: layers `first .. first + count` (global), and
    whether it is the first (embedding, vision tower) and the last (final norm, output layer)."""

    first: int
    count: int
    is_first: bool
    is_last: bool


def stage_plan(shape: LmShape, pp_rank: int, pp: int) -> StagePlan:
    """Stage `pp_rank` of `pp` equal stages (ValueError when pp does not divide the layers)."""
    if shape.layers % pp:
        raise ValueError(f"{shape.layers} layers do not split into {pp} equal pipeline stages")
    count = shape.layers // pp
    return StagePlan(first=pp_rank * count, count=count, is_first=pp_rank == 0, is_last=pp_rank == pp - 1)


def stage_params(
    shape: LmShape, stage: StagePlan, visual_names: list[str], *, fused_norms: bool = False
) -> list[ParamMap]:
    """Every megatron parameter of `stage` and the HF tensors it holds; `visual_names` are
    the vision tower's parameter names under `visual.` (first stage only). `fused_norms`: Transformer
    Engine's layer spec, whose q/k/v and fc1 linears hold the norm before them (`layer_norm_weight`)."""
    maps: list[ParamMap] = []
    if stage.is_first:
        maps += [ParamMap(mcore=f"visual.{n}", hf=(VISUAL + n,)) for n in visual_names]
        maps.append(ParamMap(mcore="lm.embedding.word_embeddings.weight", hf=(LM + "embed_tokens.weight",), split=0))
    for j in range(stage.count):
        maps += _layer(shape, j, stage.first + j, fused_norms)
    if stage.is_last:
        maps.append(ParamMap(mcore="lm.decoder.final_layernorm.weight", hf=(LM + "norm.weight",)))
        head = LM + "embed_tokens.weight" if shape.tied else HEAD
        maps.append(ParamMap(mcore="lm.output_layer.weight", hf=(head,), split=0, copy=shape.tied))
    return maps


def _layer(shape: LmShape, local: int, layer: int, fused_norms: bool) -> list[ParamMap]:
    m, h = f"lm.decoder.layers.{local}.", f"{LM}layers.{layer}."
    attn = f"{h}self_attn."
    qkv = dict(kind="qkv", split=0, q_per_group=shape.q_per_group, head_dim=shape.head_dim)
    first_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    second_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    return [
        ParamMap(mcore=m + first_norm, hf=(h + "input_layernorm.weight",)),
        ParamMap(
            mcore=m + "self_attention.linear_qkv.weight",
            hf=tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            **qkv,
        ),
        ParamMap(mcore=m + "self_attention.linear_qkv.bias", hf=tuple(f"{attn}{p}_proj.bias" for p in "qkv"), **qkv),
        ParamMap(mcore=m + "self_attention.linear_proj.weight", hf=(attn + "o_proj.weight",), split=1),
        ParamMap(mcore=m + second_norm, hf=(h + "post_attention_layernorm.weight",)),
        ParamMap(
            mcore=m + "mlp.linear_fc1.weight",
            hf=(h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            kind="gate_up",
            split=0,
        ),
        ParamMap(mcore=m + "mlp.linear_fc2.weight", hf=(h + "mlp.down_proj.weight",), split=1),
    ]


def hf_names(shape: LmShape, visual_names: list[str]) -> list[str]:
    """Every HF tensor name the megatron model holds, in the hf backend's state_dict order (a tied
    head once, under the embedding's name)."""
    names = [VISUAL + n for n in visual_names]
    names.append(LM + "embed_tokens.weight")
    for i in range(shape.layers):
        h = f"{LM}layers.{i}."
        names += [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")]
        names += [f"{h}self_attn.o_proj.weight"]
        names += [f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{h}input_layernorm.weight", f"{h}post_attention_layernorm.weight"]
    names.append(LM + "norm.weight")
    if not shape.tied:
        names.append(HEAD)
    return names
