"""Build this rank's pipeline stage of a ModelSpec: megatron's GPTModel part, the HF vision tower on
the first stage, the HF shell (meta device) whose rope index and image features the stage uses, and
the map of its parameters to HF tensors (mapping.py). `BuiltStage.fill` reads the weights (weights.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrun.config.layout import RankCoords
from vlmrun.models.spec import ModelSpec
from vlmrun.policy.megatron.mapping import LmShape, ParamMap, StagePlan, stage_params, stage_plan
from vlmrun.policy.megatron.model import StageOptions, VisionLanguageStage, layer_spec, transformer_config


@dataclass
class BuiltStage:
    """A stage and what goes with it: `maps` (its parameters' HF tensors), `tied` (the embedding and its
    copy this stage holds, for grads.py; None when the head is untied)."""

    stage: VisionLanguageStage
    shell: torch.nn.Module
    meta_model: torch.nn.Module
    spec: ModelSpec
    shape: LmShape
    plan: StagePlan
    maps: list[ParamMap]
    coords: RankCoords
    tp: int
    tied: tuple | None
    fused_norms: bool = False
    _params: dict | None = None

    def fill(self) -> str:
        """Every parameter from the spec's HF weights; returns how they were read."""
        from vlmrun.policy.megatron.weights import fill_stage, hf_reader

        read, how = hf_reader(self.spec, self.meta_model)
        fill_stage(dict(self.stage.named_parameters()), self.maps, read, tp_rank=self.coords.tp, tp=self.tp)
        return how

    def params_by_name(self) -> dict[str, torch.nn.Parameter]:
        """The stage's parameters by name (the same objects for the stage's life: loads copy into them)."""
        if self._params is None:
            self._params = dict(self.stage.named_parameters())
        return self._params


def build_stage(spec: ModelSpec, opts: StageOptions, coords: RankCoords, device: torch.device) -> BuiltStage:
    """Stage `coords.pp` of `opts.pp` of the spec's model on `device`, its tensors allocated, not filled."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from vlmrun.models.build import build_model, materialize_buffers

    meta_model = build_model(spec, on_meta=True)
    hf_config = meta_model.config
    shape = LmShape.of(hf_config)
    plan = stage_plan(shape, coords.pp, opts.pp)
    config = transformer_config(hf_config, opts)
    text = hf_config.text_config
    layers_spec, fused_norms = layer_spec(config)
    lm = GPTModel(  # allocated on the current CUDA device, or the CPU (use_cpu_initialization)
        config=config,
        transformer_layer_spec=layers_spec,
        vocab_size=shape.vocab,
        max_sequence_length=text.max_position_embeddings,
        pre_process=plan.is_first,
        post_process=plan.is_last,
        share_embeddings_and_output_weights=False,
        position_embedding_type="mrope",
        rotary_base=text.rope_parameters["rope_theta"],
        scatter_embedding_sequence_parallel=False,  # images are spliced in first (model.py)
    )
    shell = _inner(meta_model)
    visual = None
    if plan.is_first:
        visual = materialize_buffers(shell.visual, device)  # the tower's own buffers; weights: fill()
    stage = VisionLanguageStage(
        lm, visual, shell, image_token_id=hf_config.image_token_id, sequence_parallel=opts.sequence_parallel
    )
    visual_names = [n for n, _ in visual.named_parameters()] if visual is not None else []
    maps = stage_params(shape, plan, visual_names, fused_norms=fused_norms)
    params = dict(stage.named_parameters())
    for m in maps:  # what the gradient norm counts once (grads.py)
        if m.mcore in params:
            params[m.mcore].vlmrun_tp_split = m.split is not None and opts.tp > 1
    tied = _tied(stage, maps) if shape.tied else None
    return BuiltStage(stage, shell, meta_model, spec, shape, plan, maps, coords, opts.tp, tied, fused_norms)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model's inner model (Qwen's `model`: the tower, the language model, get_rope_index)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "get_rope_index") or not hasattr(inner, "visual"):
        raise TypeError(f"{type(model).__name__}: the megatron backend runs Qwen2-VL and Qwen2.5-VL models")
    return inner


def _tied(stage: VisionLanguageStage, maps: list[ParamMap]) -> tuple:
    """(embedding, output layer) parameters of a tied head on this stage (mapping.py); the copy marked."""
    params = dict(stage.named_parameters())
    embedding = params.get("lm.embedding.word_embeddings.weight")
    output = params.get("lm.output_layer.weight")
    if output is not None:
        output.vlmrun_tied_copy = True
    return embedding, output
