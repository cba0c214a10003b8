"""Per-rank memory of a tensor- and pipeline-parallel step (model.backend megatron), stage by stage.

`estimate` is what the fit check calls: this module's `estimate_stages` when the layout has tp or pp
above 1, `memory.estimate_memory` otherwise. Pure arithmetic, no torch. The terms are
`memory.estimate_memory`'s, divided by the layout:

- weights, gradients and AdamW's two states: the stage's decoder layers (layers / pp of them) and,
  on the first stage, the vision tower (whole: replicated over tp) and the embedding, on the last the
  final norm and the head (a tied head is a copy there: megatron builds it untied), every
  tensor-parallel tensor divided by tp. No FSDP gathers. Gradients accumulate in place over a step's
  micro-batches, so they are resident from the first backward on;
- activations: per micro-batch, the stage's layers with the attention and MLP widths divided by tp,
  and the hidden-size tensors too under sequence parallelism; 1F1B keeps min(pp - stage,
  micro-batches) micro-batches in flight on stage `stage`. Recompute keeps each layer's input;
- vision activations: on the first stage, per micro-batch in flight;
- logits: on the last stage, every position's vocabulary-parallel logits (vocab / tp) in the compute
  dtype, plus the labelled ones in fp32 for the loss;
- the reference stage (GRPO with KL) on every rank; the generation engine (the whole model in the
  compute dtype), its refit bucket and its generation, on each replica's first rank (stage 0, tp
  rank 0) only;
- the load: each rank reads one whole HF tensor at a time and keeps its pieces: its share of the
  weights plus the largest tensor (the embedding).
The estimate is the stage whose peak is highest (`MemoryEstimate.stage`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from vlmrun.models.memory import (
    GPU_OVERHEAD,
    MemoryEstimate,
    TrainingShape,
    _generation,
    _images,
    _vision_activations,
    estimate_memory,
    saved_per_token,
)
from vlmrun.models.params import Architecture, Block


def estimate(arch: Architecture, shape: TrainingShape) -> MemoryEstimate:
    """The per-rank estimate of `shape`'s layout: per stage above tp = pp = 1, as `estimate_memory` otherwise."""
    if shape.tp > 1 or shape.pp > 1:
        return estimate_stages(arch, shape)
    return estimate_memory(arch, shape)


def estimate_stages(arch: Architecture, shape: TrainingShape) -> MemoryEstimate:
    """The estimate of the pipeline stage that peaks highest."""
    stages = [_stage(arch, shape, s) for s in range(shape.pp)]
    return max(stages, key=lambda e: e.device_total)


def _stage(arch: Architecture, shape: TrainingShape, stage: int) -> MemoryEstimate:
    tp, pp = shape.tp, shape.pp
    compute = 2 if shape.master_dtype == "bfloat16" else 4
    master = compute
    per = len(arch.layers) // pp
    layers = arch.layers[stage * per : (stage + 1) * per]
    first, last = stage == 0, stage == pp - 1
    table = arch.vocab * arch.hidden
    params = sum(b.params for b in layers) / tp
    params += (arch.vision.params + table / tp) if first else 0
    params += (table / tp + arch.hidden) if last else 0
    params = math.ceil(params)
    in_flight = max(1, min(pp - stage, shape.micro_batches))
    tokens = shape.sequences * shape.seq_len
    engine = shape.engine and first  # the replica's first rank holds the engine
    scored = min(shape.scored_tokens or shape.seq_len, shape.seq_len)
    base = estimate_memory(arch, replace(shape, fsdp=False, reduce_every_micro_batch=False))
    return MemoryEstimate(
        params=arch.total,
        weights=params * master,
        gradients=params * master,
        optimizer=params * master * (2 if shape.optimizer == "adamw" else 0),
        offloaded=False,
        accumulated_gradients=0,
        gathered_params=0,
        gathered_gradients=0,
        activations=in_flight * tokens * _per_token(layers, shape) * compute,
        vision_activations=in_flight
        * _vision_activations(arch, shape.image_size, _images(shape.sequences, shape))
        * compute
        if first
        else 0,
        logits=shape.sequences * (shape.seq_len * compute + scored * 8) * math.ceil(arch.vocab / tp) if last else 0,
        reference=params * master if shape.reference_model else 0,
        generation=(base.generation if shape.engine_budget else _generation(arch, shape, compute)) if engine else 0,
        overhead=GPU_OVERHEAD if shape.on_gpu else 0,
        replica_accumulates=True,
        engine_weights=base.engine_weights if engine else 0,
        refit_bucket=base.refit_bucket if engine else 0,
        engine_resident=base.engine_resident and engine,
        load_host=params * master + table * master,
        load_sharded=True,
        offload_during_generation=base.offload_during_generation,
        engine_budget=base.engine_budget if engine else 0,
        stage=stage,
    )


def _per_token(layers: tuple[Block, ...], shape: TrainingShape) -> int:
    """Elements kept per token by the stage's layers under tensor (and sequence) parallelism."""
    if not layers:
        return 0
    hidden_split = shape.tp if shape.sequence_parallel else 1

    def kept(b: Block) -> float:
        whole = saved_per_token(b)
        split = whole - 8 * b.hidden  # the attention and MLP widths: divided by tp
        return 8 * b.hidden / hidden_split + split / shape.tp

    if shape.activation_checkpointing:
        return math.ceil(sum(b.hidden for b in layers) / hidden_split + max(kept(b) for b in layers))
    return math.ceil(sum(kept(b) for b in layers))
