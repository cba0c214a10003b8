"""A pipeline stage of a Qwen2-VL / Qwen2.5-VL as megatron-core runs it: the HF vision tower in front of
megatron's GPTModel (mRoPE), built from the HF config.

1. The language model is `GPTModel(position_embedding_type="mrope")` of the local layer spec (or
   Transformer Engine's where it is installed and CUDA runs: GPU only, not run here): RMSNorm, SwiGLU
   (gated fc1), q/k/v bias, no other bias, untied (a tied head is a copy: mapping.py). Every fusion
   flag is off (the fused kernels are CUDA's). Its parameters are filled from the HF weights
   (mapping.py); nothing is initialized here.
2. The vision tower is transformers' own (`model.visual`), replicated over tensor parallelism on the
   first stage: each tensor-parallel rank runs it on the same pixels and gets the same gradient (the
   embedding's gradient reaches it after the all-reduce of the first column-parallel layer), so its
   replicas stay equal without a collective of their own. Its features replace the image placeholder
   tokens' embeddings in row-major order, as transformers splices them (`decoder_input`). The 3-D
   mRoPE ids come from the HF model's own `get_rope_index` (a packed batch's, per sequence:
   models/packing.py), on an HF model built on the meta device (`shell`: no memory; its tower is ours).
3. Masks: an explicit boolean mask [B, 1, T, T] (True: masked) from the batch's attention mask: causal,
   padding keys masked, and in a packed row each token sees its own sequence only. megatron fills
   masked scores with -10000, so a padding query that sees nothing gets a uniform row, never NaN.
4. Sequence parallelism pads each micro-batch to a multiple of tp tokens (padding: masked, unlabelled).
5. The last stage returns the vocabulary-parallel logits [B, T, V/tp]; `labelled_logprobs` takes the
   log-probs of the labelled next tokens from them with megatron's vocabulary-parallel cross entropy,
   in fp32, as [B, T-1] with zeros elsewhere (policy/loss.py's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.models.packing import packed_position_ids
from vlmrun.models.shared_images import vision_once


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How the stages are cut and run: sizes of tensor and pipeline parallelism, sequence parallelism,
    full activation recompute (one layer at a time), the weights' dtype."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    dtype: torch.dtype = torch.float32


def transformer_config(hf_config, opts: StageOptions):
    """megatron-core's TransformerConfig of the HF config's language model: RMSNorm, SwiGLU, q/k/v bias, mRoPE,
    every fusion off, nothing initialized (the HF weights fill it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vlmrun.policy.megatron.mapping import LmShape

    text = hf_config.text_config
    shape = LmShape.of(hf_config)
    rope = text.rope_parameters
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=text.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        mrope_section=list(rope["mrope_section"]),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=opts.dtype,
        pipeline_dtype=opts.dtype,
        bf16=opts.dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # every parameter is read from the HF weights next
        variable_seq_lengths=opts.pp > 1,  # micro-batches differ in length: the pipeline sends shapes first
        moe_token_dispatcher_type="alltoall",  # no experts: unused (its default, allgather, refuses the line above)
        batch_p2p_comm=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=True,  # the schedule backpropagates our loss as it is (normalized already)
        **(recompute if opts.recompute else {}),
    )


def layer_spec(config) -> tuple:
    """(spec, whether its linears hold the norms before them): Transformer Engine's layer spec where it
    is installed and CUDA runs (GPU only, not run here), else the local one."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if torch.cuda.is_available() and getattr(specs, "HAVE_TE", False):
        return specs.get_gpt_layer_with_transformer_engine_spec(), True
    if config.sequence_parallel:
        from vlmrun.policy.megatron.cpu_shims import allow_sequence_parallel_norms

        allow_sequence_parallel_norms()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm"), False


class VisionLanguageStage(torch.nn.Module):
    """One pipeline stage: `visual` (first stage) and `lm` (GPTModel); `shell` is the HF
    model built on the meta device, whose `get_rope_index` and `get_image_features` this stage uses."""

    def __init__(self, lm, visual, shell, *, image_token_id: int, sequence_parallel: bool):
        super().__init__()
        self.lm = lm
        if visual is not None:
            self.visual = visual
        self.__dict__["shell"] = shell  # not a submodule: its language model is on the meta device
        self.image_token_id = image_token_id
        self.sequence_parallel = sequence_parallel

    @property
    def config(self):
        return self.lm.config

    @property
    def model_type(self):
        return self.lm.model_type

    @property
    def is_first(self) -> bool:
        return self.lm.pre_process

    @property
    def is_last(self) -> bool:
        return self.lm.post_process

    def set_input_tensor(self, tensor) -> None:
        self.lm.set_input_tensor(tensor)

    def forward(self, inputs: StageInputs) -> torch.Tensor:
        """Hidden states for the next stage, or, on the last stage, logits [B, T, V/tp]."""
        decoder_input = self._embeddings(inputs) if self.is_first else None
        return self.lm(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.mask,
            decoder_input=decoder_input,
        )

    def _embeddings(self, inputs: StageInputs) -> torch.Tensor:
        """[T(/tp under sequence parallelism), B, H]: the tokens' embeddings, images spliced in."""
        from megatron.core import tensor_parallel

        emb = self.lm.embedding(input_ids=inputs.input_ids, position_ids=None)  # [T, B, H], whole
        if inputs.pixel_values is not None:
            with vision_once(self.shell, inputs.image_source):
                out = self.shell.get_image_features(inputs.pixel_values, inputs.image_grid_thw)
            features = torch.cat(out.pooler_output, dim=0).to(emb.dtype)
            rows = emb.transpose(0, 1)
            placeholders = (inputs.input_ids == self.image_token_id).unsqueeze(-1).expand_as(rows)
            emb = rows.masked_scatter(placeholders, features).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb


@dataclass
class StageInputs:
    """A micro-batch as every stage takes it: tokens, mRoPE ids [3, B, T], the mask,
    media (first stage), and for scoring the next token of each position (`targets`, 0 where
    `scored` is False)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_source: tuple[int, ...] | None = None


def stage_inputs(batch, shell, *, multiple: int = 1, device: torch.device | None = None) -> StageInputs:
    """`batch` (data/batch.py's `Batch`, padded or packed) as a stage takes it, its tokens padded to a
    multiple of `multiple` (sequence parallelism), on `device`."""
    ids, seq, labels = batch.input_ids, batch.attention_mask.long(), batch.labels
    positions = _positions(batch, shell)
    pad = (-ids.shape[1]) % multiple
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
        seq = torch.nn.functional.pad(seq, (0, pad))
        labels = torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX)
        tail = positions[..., -1:] + torch.arange(1, pad + 1)
        positions = torch.cat([positions, tail], dim=-1)
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    targets = torch.zeros_like(labels)
    targets[:, :-1] = labels[:, 1:].clamp(min=0)
    media = batch.media
    out = StageInputs(
        input_ids=ids,
        position_ids=positions,
        mask=attention_mask(seq),
        targets=targets,
        scored=scored,
        pixel_values=media.get("pixel_values"),
        image_grid_thw=media.get("image_grid_thw"),
        image_source=batch.image_source,
    )
    if device is not None:
        for name in ("input_ids", "position_ids", "mask", "targets", "scored", "pixel_values", "image_grid_thw"):
            value = getattr(out, name)
            if value is not None:
                setattr(out, name, value.to(device))
    return out


def _positions(batch, shell) -> torch.Tensor:
    """[3, B, T] mRoPE ids as transformers computes them for the batch (a packed one's per sequence)."""
    if batch.is_packed:
        return packed_position_ids(shell, batch)[1:]
    grid = batch.media.get("image_grid_thw")
    types = batch.token_inputs.get("mm_token_type_ids")
    if grid is None or types is None:  # text only: transformers' own positions, 0..T-1 on every axis
        rows, width = batch.input_ids.shape
        return torch.arange(width).view(1, 1, -1).expand(3, rows, width).clone()
    positions, _ = shell.get_rope_index(
        batch.input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=batch.attention_mask
    )
    return positions


def attention_mask(sequences: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where a query must not see a key (causal, padding keys, another sequence of a
    packed row), from [B, T] sequence
    numbers (1 for every token of a padded row, 1, 2, ... for a packed row's sequences; 0: padding)."""
    width = sequences.shape[1]
    future = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)
    same = sequences.unsqueeze(2) == sequences.unsqueeze(1)
    visible = same & ~future & (sequences.unsqueeze(1) > 0)
    return (~visible).unsqueeze(1)


def labelled_logprobs(logits: torch.Tensor, inputs: StageInputs, width: int) -> torch.Tensor:
    """log p(next token) at the scored positions from vocabulary-parallel logits [B, T, V/tp], as
    [B, width - 1] float32 with zeros elsewhere (`width`: the batch's tokens before any padding)."""
    from megatron.core import tensor_parallel

    scored = inputs.scored
    picked = -tensor_parallel.vocab_parallel_cross_entropy(logits[scored].float(), inputs.targets[scored])
    out = torch.zeros(scored.shape, dtype=torch.float32, device=logits.device).masked_scatter(scored, picked)
    return out[:, : width - 1]
