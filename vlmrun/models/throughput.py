"""An estimate of a GPU recipe's training tokens per second per GPU, from the model's FLOPs and the
layout's traffic: what `vlmrun submit --dry-run` prints beside the memory estimate. An estimate, not a
measurement (the GPU checks in tools/gpu measure; docs/measurements.md has what they found).

Pure arithmetic over `params.Architecture` and the recipe (no torch), per rank and optimizer step:

1. Tokens: every trained sequence's tokens, prompt and response. A synthetic CLEVR sample is its
   image's tokens and SYNTHETIC_TEXT_TOKENS of chat template, question and answer (GRPO: its prompt and
   `grpo.max_new_tokens`); a user's data counts `data.max_seq_len` a sample, the bound (an optimistic
   rate where samples are shorter).
2. Compute: 2 FLOPs per active parameter and token a forward (MoE: the routed top-k experts and the
   shared one; the LM head at the labelled positions only), the attention scores and values
   4 x query width x context per token, and the vision tower's parameters per patch (one encoding per
   image). Training is 3 forwards' worth, 4 for the decoder layers with activation checkpointing (the
   recomputed forward); GRPO adds its logprob stage's forwards (the reference's too) and the rollout's
   prefill. All at COMPUTE_EFFICIENCY of the matmul ceiling.
3. Device traffic: FSDP2 all-gathers the compute-dtype weights for each forward and each backward of
   a micro-batch and reduce-scatters the gradients (each micro-batch, or once a step); each moves
   (shard - 1) / shard of the model per rank, at NVLINK within a node or NETWORK when a shard group spans
   nodes. HSDP adds the all-reduce of the gradient shards over the replicas. parallel.cpu_offload adds
   the copies between host and GPU at PCIE: the fp32 shards in before each all-gather, the gradient
   shards out after each reduce-scatter.
4. Host: with parallel.cpu_offload the optimizer step runs on the rank's CPU threads
   (`cluster.threads_per_gpu_rank`) at HOST_ADAMW_PARAMS_PER_S each.
5. GRPO's rollout: the refit gathers the model into the engine (and, offloaded, copies the shards in);
   each decoded token reads the engine's weights once (HBM bound) on top of its FLOPs.
6. The step: compute and device traffic overlap (FSDP2 prefetches the next gather), so the larger of
   the two counts; the host's optimizer step and the rollout come on top.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlmrun.models.memory import image_tokens
from vlmrun.models.params import Architecture, Block

#: bf16 dense matmul TFLOPS an H100/H200 sustains (the GPU check's ceiling on the lent H200: 781 of the
#: datasheet's 989; docs/measurements.md), and the share of it a training step reaches (the GPU check's
#: MFU goal against that ceiling).
MATMUL_CEILING_FLOPS = 781e12
COMPUTE_EFFICIENCY = 0.4
#: Bytes per second per GPU: an all-gather or reduce-scatter over NVLink within a node, over the network
#: between nodes (a 400 Gb/s NIC a GPU), pinned host <-> GPU copies over PCIe, and HBM reads (H100 SXM).
NVLINK = 300e9
NETWORK = 40e9
PCIE = 25e9
HBM = 3.35e12
#: AdamW parameters a CPU thread steps per second (fp32, torch's per-tensor loop).
HOST_ADAMW_PARAMS_PER_S = 109e6
#: Tokens of a synthetic CLEVR sample besides its image: the chat template, the question and the answer.
SYNTHETIC_TEXT_TOKENS = 48


@dataclass(frozen=True)
class ThroughputEstimate:
    """Seconds per optimizer step by part, and the training tokens a rank trains in it."""

    tokens_per_step: int
    flops_per_step: float
    compute_s: float
    traffic_s: float
    host_s: float
    rollout_s: float
    assumption: str

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.traffic_s) + self.host_s + self.rollout_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> dict:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return out | {"step_s": round(self.step_s, 4), "tokens_per_s": round(self.tokens_per_s, 1)}

    def line(self) -> str:
        """One line for a person."""
        return (
            f"{self.tokens_per_s:,.0f} tokens/s per GPU (estimate): a step of {self.tokens_per_step:,} tokens per "
            f"rank in ~{self.step_s:.2f} s = max(compute {self.compute_s:.2f}, traffic {self.traffic_s:.2f}) + "
            f"host {self.host_s:.2f} + rollout {self.rollout_s:.2f}"
        )


def active_params(block: Block) -> int:
    """Parameters a token passes through in `block`: all of them but a MoE layer's unrouted experts."""
    if block.kind != "moe":
        return block.params
    return 2 * block.hidden * block.ffn_width  # the top-k experts' and the shared expert's up and down


def _attention_flops(arch: Architecture, context: int) -> float:
    """Forward FLOPs of the attention scores and values, per token, at `context` tokens."""
    query = sum(b.attn_width - b.kv_width for b in arch.layers if b.kv_width)
    return 4.0 * query * context


def sequence_tokens(recipe, arch: Architecture) -> tuple[int, int, str]:
    """(a trained sequence's tokens, its prompt's, where they come from) (module doc)."""
    d, grpo = recipe.data, recipe.train.algorithm == "grpo"
    response = recipe.grpo.max_new_tokens if grpo else 0
    if d.synthetic is None:
        return d.max_seq_len + response, d.max_seq_len, "data.max_seq_len tokens a sample (data.synthetic unset)"
    image = (image_tokens(arch, d.synthetic.image_size) - arch.vision.extra_tokens) // 4
    prompt = image + SYNTHETIC_TEXT_TOKENS
    return prompt + response, prompt, f"a synthetic CLEVR sample: {image} image + {SYNTHETIC_TEXT_TOKENS} text tokens"


def estimate_throughput(arch: Architecture, recipe, *, compute_bytes: int, scored: int | None) -> ThroughputEstimate:
    """The estimate for `recipe` (a GPU recipe) of `arch`; `compute_bytes` per weight in the compute
    dtype, `scored` the labelled tokens of a sequence (None: all of them)."""
    t, p, c = recipe.train, recipe.parallel, recipe.cluster
    grpo = t.algorithm == "grpo"
    per_prompt = recipe.grpo.num_generations if grpo else 1
    prompts = t.global_batch_size // p.dp
    sequences = prompts * per_prompt
    length, prompt_len, where = sequence_tokens(recipe, arch)
    tokens = sequences * length
    decoder = sum(active_params(b) for b in arch.layers)
    head = arch.vocab * arch.hidden
    forward = decoder * 2.0 * tokens + _attention_flops(arch, length) * tokens
    forward += 2.0 * head * sequences * min(scored or length, length)
    images = prompts if grpo else sequences  # a GRPO prompt's responses read one encoding of its image
    patches = image_tokens(arch, recipe.data.synthetic.image_size if recipe.data.synthetic else 448)
    vision = 2.0 * arch.vision.params * patches * images
    train = 3 * (forward + vision) + (forward if p.activation_checkpointing else 0.0)
    flops = train
    if grpo:  # the logprob stage's forwards (and the reference's), and the rollout's prefill
        flops += (2 if recipe.grpo.kl_coef > 0 else 1) * (forward + vision)
    compute_s = flops / (MATMUL_CEILING_FLOPS * COMPUTE_EFFICIENCY)
    traffic_s, host_s = _traffic(arch, recipe, compute_bytes)
    rollout_s = _rollout(arch, recipe, compute_bytes, prompts * per_prompt, prompt_len) if grpo else 0.0
    said = (
        f"{where}; {COMPUTE_EFFICIENCY:.0%} of {MATMUL_CEILING_FLOPS / 1e12:.0f} TFLOPS, NVLink {NVLINK / 1e9:.0f} GB/s, "
        f"network {NETWORK / 1e9:.0f} GB/s, PCIe {PCIE / 1e9:.0f} GB/s, host AdamW "
        f"{HOST_ADAMW_PARAMS_PER_S / 1e6:.0f}M params/s x {c.threads_per_gpu_rank} threads"
    )
    return ThroughputEstimate(tokens, flops, compute_s, traffic_s, host_s, rollout_s, said)


def _shard_group(recipe) -> tuple[int, float]:
    """(ranks one copy of the state is sharded over, the bytes/s their collectives run at)."""
    p, c = recipe.parallel, recipe.cluster
    shard = p.layout.shard_group if p.sharded else 1
    return shard, NVLINK if shard <= max(1, c.gpus_per_node) else NETWORK


def _traffic(arch: Architecture, recipe, compute_bytes: int) -> tuple[float, float]:
    """(device traffic seconds a step, host seconds a step) (module doc)."""
    t, p, c = recipe.train, recipe.parallel, recipe.cluster
    n, grpo = arch.total, t.algorithm == "grpo"
    shard, rate = _shard_group(recipe)
    micro = max(1, t.global_batch_size // p.dp // t.micro_batch_size)
    forwards = micro * (2 if grpo else 1) + (micro if grpo and recipe.grpo.kl_coef > 0 else 0)
    gathers = (forwards + micro) if p.sharded else 0
    reduces = (micro if p.reduce_every_micro_batch else (recipe.grpo.inner_steps if grpo else 1)) if p.sharded else 0
    master = 2 if recipe.model.dtype == "bfloat16" else 4
    reduce_bytes = 4 if p.mixed_precision == "bf16" else master
    moved = (shard - 1) / shard
    seconds = gathers * n * compute_bytes * moved / rate + reduces * n * reduce_bytes * moved / rate
    if p.sharded and p.layout.replicas > 1:  # HSDP: the shards' all-reduce over the replicas
        seconds += reduces * 2 * n / shard * reduce_bytes / (NETWORK if c.nodes > 1 else NVLINK)
    if not p.sharded and p.dp > 1:  # replicas: one all-reduce of the whole gradient
        seconds += 2 * n * master / (NETWORK if c.nodes > 1 else NVLINK)
    own = n / shard
    if not p.cpu_offload:
        return seconds, 0.0
    seconds += (gathers * own * master + reduces * own * reduce_bytes) / PCIE
    return seconds, own / (HOST_ADAMW_PARAMS_PER_S * c.threads_per_gpu_rank)


def _rollout(arch: Architecture, recipe, compute_bytes: int, rows: int, prompt_len: int) -> float:
    """Seconds of GRPO's refit and generation a step (module doc)."""
    g, p = recipe.grpo, recipe.parallel
    n = arch.total
    shard, rate = _shard_group(recipe)
    refit = n * compute_bytes * (shard - 1) / shard / rate
    if p.cpu_offload:
        refit += n / shard * (2 if recipe.model.dtype == "bfloat16" else 4) / PCIE
    decoder = sum(active_params(b) for b in arch.layers) + arch.vocab * arch.hidden
    prefill = 2.0 * decoder * rows * prompt_len / (MATMUL_CEILING_FLOPS * COMPUTE_EFFICIENCY)
    decode = g.max_new_tokens * max(n * compute_bytes / HBM, 2.0 * decoder * rows / MATMUL_CEILING_FLOPS)
    return refit + prefill + decode
