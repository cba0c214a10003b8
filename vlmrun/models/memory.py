"""Per-rank memory of one training step, estimated from the architecture and the parallel layout.

Pure arithmetic over `params.Architecture` (no torch): `vlmrun submit` runs it on a login node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from vlmrun.models.params import Architecture, Block

GIB = 1 << 30
GPU_OVERHEAD = 2 * GIB
#: A vllm engine's own process on the rank's GPU (item 18): its CUDA context and allocator slack, held
#: while it sleeps too.
ENGINE_PROCESS_OVERHEAD = 1 * GIB
ADAMW_STATES = 2


@dataclass(frozen=True, kw_only=True)
class TrainingShape:
    """What one rank runs: precision, sharding and the biggest micro-batch.

    `sequences` per training micro-batch (GRPO: prompts x generations), each of `seq_len` tokens with
    one `image_size` px image, `micro_batches` of them per optimizer step; `generation_sequences` > 0 when the rank also samples (GRPO) with the
    engine's own copy of the weights; `reference_model`: a frozen copy of the policy is resident (GRPO
    kl_coef > 0); `engine`: the rank holds a generation engine (GRPO, or an SFT validation pass),
    `engine_resident`: its weights stay between uses, `refit_bucket`: the bytes a refit streams at once.
    `scored_tokens`: the most tokens of a sequence that carry a label (the only positions the policy
    projects onto the vocabulary): GRPO's response bound, or the whole sequence (None) for SFT, whose
    answers may be any length. `image_share`: how many sequences show one image, which the vision
    tower encodes once for all of them (GRPO: a prompt's responses, models/shared_images.py).
    """

    master_dtype: str = "float32"
    mixed_precision: str = "none"
    fsdp: bool = False
    dp: int = 1  # the ranks FSDP shards one copy over: parallel.dp, or dp_shard under HSDP
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reduce_every_micro_batch: bool = False
    optimizer: str = "adamw"
    sequences: int = 1
    micro_batches: int = 1
    seq_len: int = 1024
    image_size: int = 448
    on_gpu: bool = True
    reference_model: bool = False
    generation_sequences: int = 0
    engine: bool = False  # the rank holds a generation engine: GRPO's, or SFT's for a validation pass
    engine_resident: bool = False  # GRPO's engine keeps its weights between rollouts (no generation.release_weights)
    refit_bucket: int = 0  # bytes of one refit bucket (generation.refit_bucket_mb)
    scored_tokens: int | None = None  # labelled tokens per sequence at most (None: seq_len)
    image_share: int = 1  # sequences that show one image, encoded once for them (GRPO: a prompt's G responses)
    offload_during_generation: bool = False  # the policy's state goes to host memory for the rollout (item 17)
    engine_budget: int = 0  # bytes a vLLM engine takes while it generates (gpu_memory_utilization x GPU; item 18)
    trained_params: int | None = None  # the parameters that train (model.lora: its adapters); None: every one
    tp: int = 1  # tensor parallel (model.backend megatron): models/memory_layout.py
    pp: int = 1  # pipeline stages
    sequence_parallel: bool = False


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per rank of each term (numbered in `estimate_memory`); offloaded terms live in host memory."""

    params: int
    weights: int
    gradients: int
    optimizer: int
    offloaded: bool
    accumulated_gradients: int
    gathered_params: int
    gathered_gradients: int
    activations: int
    vision_activations: int
    logits: int
    reference: int
    generation: int
    overhead: int
    replica_accumulates: bool = False
    engine_weights: int = 0
    refit_bucket: int = 0
    engine_resident: bool = False
    load_host: int = 0  # host bytes per rank while the policy loads (item 16)
    load_sharded: bool = False  # each rank reads only its share of the files (item 16)
    offload_during_generation: bool = False  # item 17
    engine_budget: int = 0  # item 18
    stage: int | None = None  # the pipeline stage this estimate is of (models/memory_layout.py), when pp or tp > 1

    @property
    def sharded_state(self) -> int:
        """Weights, gradients and optimizer state held by this rank (on the device or, offloaded, the host)."""
        return self.weights + self.gradients + self.optimizer

    @property
    def host_per_rank(self) -> int:
        return self.sharded_state + self.reference if self.offloaded else 0

    @property
    def rollout_host(self) -> int:
        """Host bytes per rank while the rollout runs with offload_during_generation (17): the weights,
        the reference's and the optimizer's state."""
        return self.weights + self.reference + self.optimizer if self.offload_during_generation else 0

    @property
    def host_peak_per_rank(self) -> int:
        """Host memory per rank at its peak: while loading (16), the offloaded state after (4), or the
        state moved there for the rollout (17)."""
        offloaded = self.host_per_rank + (self.load_host if self.offloaded and self.reference else 0)
        return max(self.load_host, offloaded, self.rollout_host)

    def resident_terms(self, phase: str | None = None) -> dict[str, int]:
        """Device bytes the policy and the engine hold through `phase` (None: the whole step; the
        overhead is added last, in `peak_terms`): with offload_during_generation (17) the optimizer's
        state is on the host from the refit on, and the weights during generation."""
        on_device = 0 if self.offloaded else 1
        away = self.offload_during_generation
        return {
            "weights": 0 if away and phase == "generation" else self.weights * on_device,
            "optimizer": 0 if away and phase in ("refit", "generation") else self.optimizer * on_device,
            "reference model": 0 if away and phase == "generation" else self.reference * on_device,
            "generation engine": self.engine_weights if self.engine_resident else 0,
            "engine process": ENGINE_PROCESS_OVERHEAD if self.engine_budget else 0,
        }

    def phase_terms(self) -> dict[str, dict[str, int]]:
        """Device bytes on top of the resident ones at each moment that can peak (item 12)."""
        grads = 0 if self.offloaded else self.gradients
        forward = {
            "gradients": grads if self.replica_accumulates else 0,
            "accumulated gradients": self.accumulated_gradients,
            "fsdp gathers": self.gathered_params,
            "activations": self.activations,
            "vision activations": self.vision_activations,
            "logits": self.logits,
        }
        backward = {
            "gradients": grads,
            "accumulated gradients": self.accumulated_gradients,
            "fsdp gathers": self.gathered_params + self.gathered_gradients,
        }
        phases = {"forward": forward, "backward": backward}
        if self.engine_weights:  # the engine's weights, when they are not resident, come back at refit
            engine = {"generation engine": 0 if self.engine_resident else self.engine_weights}  # no gradients (2)
            phases["refit"] = engine | {"refit bucket": self.refit_bucket}
            if self.generation:
                phases["generation"] = engine | {"generation": self.generation}
        return phases

    def phase_total(self, phase: str) -> int:
        """Device bytes at the end of `phase` (a key of `phase_terms`), the overhead included."""
        return sum(self.resident_terms(phase).values()) + sum(self.phase_terms()[phase].values()) + self.overhead

    @property
    def peak_phase(self) -> str:
        return max(self.phase_terms(), key=self.phase_total)

    def peak_terms(self) -> dict[str, int]:
        """The non-zero terms that sum to `device_total`."""
        phase = self.peak_phase
        terms = self.resident_terms(phase) | self.phase_terms()[phase] | {"overhead": self.overhead}
        return {name: value for name, value in terms.items() if value}

    @property
    def device_total(self) -> int:
        """The estimated peak on the device (GPU, or host memory for a CPU run)."""
        return sum(self.peak_terms().values())

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(device_total=self.device_total, host_per_rank=self.host_per_rank, peak_phase=self.peak_phase)
        out["host_peak_per_rank"] = self.host_peak_per_rank
        out["phase_totals"] = {phase: self.phase_total(phase) for phase in self.phase_terms()}
        return out


def estimate_memory(arch: Architecture, shape: TrainingShape) -> MemoryEstimate:
    """Estimate the peak bytes per rank of one training step of `arch` laid out as `shape`.

    The model, each term numbered as in the list below:

    1. Weights: every parameter (vision, projector, audio and all MoE experts included) in the
       master dtype (model.dtype), divided by dp under FSDP, whole on every rank otherwise.
    2. Gradients: same dtype and sharding as the weights; they exist from the step's reduce-scatter
       (FSDP) or first backward (replicas) until its optimizer step, which frees them
       (`zero_grad(set_to_none=True)` at the step's start and right after the update).
    3. Optimizer: AdamW keeps 2 states per parameter in the parameter's dtype (torch.optim.AdamW
       allocates them like the parameter: fp32 for fp32 master weights); SGD without momentum, none.
    4. cpu_offload moves 1-3 to host memory (FSDP2 CPUOffloadPolicy); `host_per_rank` reports them.
    5. Accumulated gradients: with FSDP and several micro-batches per step, the policy reduce-scatters
       only after the last one, and FSDP2 keeps every parameter's gradient unsharded until then, in
       fp32 under bf16 mixed precision (`set_requires_gradient_sync(False)`): the whole model's, on
       every GPU, offloaded or not; none with `parallel.reduce_every_micro_batch`.
    6. FSDP gathers: the unsharded copy, in the compute dtype, of the root unit (embeddings, head,
       vision and audio towers: FSDP2 keeps the root gathered from forward to backward) and of 2
       decoder layers (the one computing and the one prefetched); in the backward also their
       unsharded gradients before the reduce-scatter (with bf16 also the fp32 copy it reduces).
    7. Activations per micro-batch of `sequences x seq_len` tokens: per decoder layer, per token,
       8 x hidden (norms, their fp32 upcast, residual) + 3 x (q+k+v) (projections, rotary copies,
       attention output) + 4 (gated) or 3 x the feed-forward width (top-k experts and the shared one
       for MoE; 2 x hidden x top-k for the dispatch copies) + 3 x Mamba's scan width, in the compute
       dtype. With activation checkpointing: each layer keeps only its input (hidden per token) and one
       layer at a time is recomputed. No seq_len^2 term: SDPA runs a fused kernel on these inputs
       (measured: restricting it to flash/memory-efficient kernels changed nothing). The constants
       are checked against measured peaks (docs/measurements.md), not derived op by op.
    8. Vision activations: the same per-token rule over one image's patches per distinct image (one
       per sequence, one per `image_share` sequences), every block kept (the vision tower is not
       checkpointed).
    9. Logits: the labelled tokens (`scored_tokens` per sequence: the policy projects only those
       positions, policy/loss.py) x vocab in the compute dtype, its fp32 upcast and the fp32
       log-softmax the loss keeps.
    10. Reference (GRPO with kl_coef > 0): a frozen copy in model.dtype, sharded and offloaded like
        the policy.
    11. Generation (GRPO): KV cache and Mamba state for `generation_sequences x seq_len` tokens, one
        layer's working set and the sampler's logits, beside the engine's weights (14).
    12. The peak: what stays resident (1 and 3 unless offloaded, 10, 13, and 14 when the engine keeps
        its weights) plus the largest of four moments: the end of the last micro-batch's forward (5,
        6, 7, 8, 9; and 2 for replicas that accumulate), the end of the backward (2, 5, 6 with
        gradients), the refit (14 unless resident, 15) and generation (11, 14 unless resident): the
        gradients are freed by then.
        A validation pass (SFT's engine, opened for it) is a refit moment too.
    14. Generation engine: its own whole copy of the model in the compute dtype, on every rank
        (sharding does not reach it); resident through the step unless `generation.release_weights`.
    15. Refit bucket: the whole tensors the policy streams to the engine at once
        (`generation.refit_bucket_mb`; a tensor larger than that alone); twice that for a vLLM engine
        (18), whose process reads each bucket from a copy in a buffer it maps (generation/vllm_wire.py).
    13. Overhead: CUDA context, NCCL buffers and allocator slack, 2 GiB on a GPU; none on CPU.
    18. A vLLM engine (generation.backend: vllm) takes `engine_budget` while it generates (its
        weights, 14, and a KV cache pool filling the rest of its gpu_memory_utilization: 11 is that
        rest) and sleeps while the policy trains (weights and KV cache freed: never resident). It runs
        in a process of its own on the rank's GPU, whose CUDA context and allocator slack
        (ENGINE_PROCESS_OVERHEAD) stay through every phase, asleep or not. A CPU run's engine is not
        counted (its estimate is the policy's host memory per rank).
    17. offload_during_generation (GRPO): the optimizer's state (3) leaves the device before the refit,
        the weights (1) and the reference (10) right after it; all come back once the engine has
        generated. The refit phase then holds no optimizer state, generation none of the policy; the
        host holds 1, 3 and 10 per rank meanwhile (`rollout_host`).
    19. LoRA (`trained_params`): gradients (2, 5) and optimizer state (3) exist for the adapters only
        (models/lora_params.py); the weights (1) are the frozen base's plus the adapters'. GRPO's
        reference (10) is the base with the adapters off: no copy.
    16. Host memory at load, per rank: sharded (FSDP), the rank reads only its rows of the files
        (models/sharded_load.py): its share of the weights (1) plus the 64 MB staging buffer, and
        on a GPU the largest of its tensor shards staged on the way to the device; replicated, the
        whole model in the master dtype (`from_pretrained` on every rank). The reference (10) loads
        the same way after the policy; with cpu_offload its load adds to the policy's offloaded state.
    """
    compute = 2 if shape.mixed_precision == "bf16" or shape.master_dtype == "bfloat16" else 4
    master = 2 if shape.master_dtype == "bfloat16" else 4
    sharded = math.ceil(arch.total / (shape.dp if shape.fsdp else 1))
    trained = arch.total if shape.trained_params is None else shape.trained_params
    trains = math.ceil(trained / (shape.dp if shape.fsdp else 1))  # LoRA: the adapters alone
    accumulates = shape.micro_batches > 1 and not (shape.fsdp and shape.reduce_every_micro_batch)
    tokens = shape.sequences * shape.seq_len
    return MemoryEstimate(
        params=arch.total,
        weights=(sharded + (trains if shape.trained_params is not None else 0)) * master,
        gradients=trains * master,
        optimizer=trains * master * (ADAMW_STATES if shape.optimizer == "adamw" else 0),
        offloaded=shape.cpu_offload,
        accumulated_gradients=trained * _reduce_bytes(shape, master) if shape.fsdp and accumulates else 0,
        gathered_params=(arch.root_params + 2 * arch.largest_layer) * compute if shape.fsdp else 0,
        gathered_gradients=(arch.root_params + arch.largest_layer) * (compute + _upcast(shape)) if shape.fsdp else 0,
        activations=_decoder_activations(arch, shape.activation_checkpointing, tokens) * compute,
        vision_activations=_vision_activations(arch, shape.image_size, _images(shape.sequences, shape)) * compute,
        logits=shape.sequences * min(shape.scored_tokens or shape.seq_len, shape.seq_len) * arch.vocab * (compute + 8),
        reference=sharded * master if shape.reference_model else 0,
        generation=max(0, shape.engine_budget - arch.total * compute)
        if shape.engine_budget
        else _generation(arch, shape, compute),
        overhead=GPU_OVERHEAD if shape.on_gpu else 0,
        replica_accumulates=accumulates and not shape.fsdp,
        engine_weights=arch.total * compute if shape.engine else 0,
        refit_bucket=min(shape.refit_bucket, arch.total * compute) * (2 if shape.engine_budget else 1)
        if shape.engine
        else 0,
        engine_resident=shape.engine and shape.engine_resident and not shape.engine_budget,
        load_host=_load_host(arch, shape, sharded * master, master),
        load_sharded=shape.fsdp,
        offload_during_generation=shape.offload_during_generation and shape.engine,
        engine_budget=shape.engine_budget if shape.engine else 0,
    )


#: The sharded load's staging buffer (models/sharded_load.py CHUNK_BYTES).
LOAD_BUFFER = 64 << 20


def _load_host(arch: Architecture, shape: TrainingShape, share: int, master: int) -> int:
    """Item 16 of `estimate_memory`."""
    if not shape.fsdp:
        return arch.total * master
    staged = math.ceil(arch.vocab * arch.hidden / shape.dp) * master if shape.on_gpu else 0
    return share + LOAD_BUFFER + staged


def _upcast(shape: TrainingShape) -> int:
    """Bytes of the fp32 gradient copy bf16 mixed precision reduces in (0 without it)."""
    return 4 if shape.mixed_precision == "bf16" else 0


def _reduce_bytes(shape: TrainingShape, master: int) -> int:
    return 4 if shape.mixed_precision == "bf16" else master


def saved_per_token(block: Block) -> int:
    """Elements autograd keeps per token for one layer (item 6 of `estimate_memory`)."""
    ffn = (4 if block.gated else 3) * block.ffn_width
    dispatch = 2 * block.hidden * block.experts_per_token
    return 8 * block.hidden + 3 * block.attn_width + ffn + dispatch + 3 * block.scan_width


def _decoder_activations(arch: Architecture, checkpointing: bool, tokens: int) -> int:
    if checkpointing:
        inputs = sum(b.hidden for b in arch.layers)
        return tokens * (inputs + max(saved_per_token(b) for b in arch.layers))
    return tokens * sum(saved_per_token(b) for b in arch.layers)


def _images(sequences: int, shape: TrainingShape) -> int:
    """The distinct images `sequences` sequences show: what the vision tower encodes."""
    return math.ceil(sequences / max(shape.image_share, 1))


def image_tokens(arch: Architecture, image_size: int) -> int:
    """Vision-tower tokens of one square image: patches (the side rounded up to an even count) plus
    the tower's cls/register tokens."""
    side = 2 * math.ceil(image_size / arch.vision.patch_size / 2)
    return side * side + arch.vision.extra_tokens


def _vision_activations(arch: Architecture, image_size: int, images: int) -> int:
    v = arch.vision
    return images * image_tokens(arch, image_size) * v.depth * saved_per_token(v.block)


def _generation(arch: Architecture, shape: TrainingShape, compute: int) -> int:
    sequences = shape.generation_sequences
    if not sequences:
        return 0
    tokens = sequences * shape.seq_len
    cache = tokens * sum(b.kv_width for b in arch.layers) * compute
    cache += sequences * sum(b.state_elems for b in arch.layers) * 4  # Mamba's state is kept in fp32
    working = tokens * max(saved_per_token(b) for b in arch.layers) * compute
    working += (
        _images(sequences, shape) * image_tokens(arch, shape.image_size) * saved_per_token(arch.vision.block) * compute
    )
    return cache + working + sequences * arch.vocab * 8
