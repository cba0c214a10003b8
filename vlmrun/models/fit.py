"""The memory-fit check at submit: refuse a GPU recipe whose estimate exceeds the GPU, warn near it.

Only GPU recipes (cluster.gpus_per_node > 0) are checked against `cluster.gpu_memory_gb`, and the
node's host memory at its peak (the ranks loading the model, or with parallel.cpu_offload the state
it keeps there) against `cluster.mem_gb` when it is set. A CPU recipe's
estimate (host memory per rank) is reported and never refused. A refusal names only the changes that
lower this estimate: each candidate is applied to the recipe and estimated again (`_remedies`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vlmrun.errors import InputError
from vlmrun.models.architecture import ArchitectureSource, load_architecture
from vlmrun.models.fit_remedies import candidate_changes
from vlmrun.models.layout_check import check_layout
from vlmrun.models.lora_params import adapter_params
from vlmrun.models.memory import GIB, MemoryEstimate, TrainingShape
from vlmrun.models.memory_layout import estimate
from vlmrun.models.params import Architecture, UnknownArchitecture
from vlmrun.models.throughput import ThroughputEstimate, estimate_throughput

WARN_FRACTION = 0.9
#: Vision-tower patches per language-model token: both families merge 2 x 2 patches into one token
#: (Qwen's spatial merge, Nemotron-Omni's pixel shuffle at downsample_ratio 0.5).
PATCHES_PER_TOKEN = 4
#: Labelled tokens of a synthetic CLEVR sample at most: its answer (a count, yes or no: a few bytes) and the
#: template's end of turn, with room to spare for any byte-level tokenizer (tests/test_fit_check.py counts them).
SYNTHETIC_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class MemoryFit:
    """The estimate of a recipe, its limit and verdict; `estimate` is None when it could not be made."""

    estimate: MemoryEstimate | None
    source: str
    limit: int | None
    source_note: str = ""
    host_limit: int | None = None
    ranks_per_node: int = 1
    warning: str | None = None
    assumption: str = ""
    throughput: ThroughputEstimate | None = None  # a GPU recipe's tokens/s per GPU, estimated (throughput.py)

    @property
    def host_per_node(self) -> int:
        return self.estimate.host_peak_per_rank * self.ranks_per_node if self.estimate else 0

    def to_json(self) -> dict:
        """For `--json` output: bytes per rank of every term, the limit and the verdict."""
        out = {"config": self.source, "config_note": self.source_note, "limit_bytes": self.limit}
        out["warning"] = self.warning
        if self.estimate is not None:
            out |= self.estimate.to_json() | {"host_per_node": self.host_per_node, "assumption": self.assumption}
            out["device_total_gib"] = round(self.estimate.device_total / GIB, 2)
        if self.throughput is not None:
            out["tokens_per_s"] = round(self.throughput.tokens_per_s, 1)
            out["throughput_estimate"] = self.throughput.to_json()
        return out

    def report_lines(self) -> list[str]:
        """The estimate as lines for a person (the dry run prints them as YAML comments)."""
        if self.estimate is None:
            return [f"memory estimate: none ({self.warning})"]
        e, where = self.estimate, "per GPU" if self.limit is not None else "per rank (CPU: host memory)"
        note = f" ({self.source_note})" if self.source_note else ""
        lines = [f"memory estimate {where}: {_count(e.params)} parameters, config {self.source}{note}"]
        lines.append(f"  peak at the end of the {e.peak_phase}:")
        lines += [f"  {name:<22} {_size(value):>10}" for name, value in e.peak_terms().items()]
        verdict = f"of {_size(self.limit)} (cluster.gpu_memory_gb)" if self.limit else ""
        lines.append(f"  {'total':<22} {_size(e.device_total):>10} {verdict}".rstrip())
        phases = ", ".join(f"{phase} {_size(e.phase_total(phase))}" for phase in e.phase_terms())
        lines.append(f"  {'each phase':<22} {phases}")
        if self.limit is not None:
            lines.append(f"  {'host, per node':<22} {_size(self.host_per_node):>10} ({_host_words(self)})")
        lines.append(f"  assuming {self.assumption}")
        if self.throughput is not None:
            lines += [f"throughput: {self.throughput.line()}", f"  assuming {self.throughput.assumption}"]
        return lines + ([f"warning: {self.warning}"] if self.warning else [])


#: What a GPU sold as N GB offers, per GiB of N: an H100 80GB has 81559 MiB (79.6 GiB), an H200 141GB
#: 143771 MiB (140.4 GiB): both 99.56% of their name in GiB (CUDA's context comes out of it: overhead).
DEVICE_FRACTION = 81559 / (80 * 1024)


def device_bytes(gpu_memory_gb: int) -> int:
    """The bytes a GPU of `cluster.gpu_memory_gb` offers (DEVICE_FRACTION of that many GiB)."""
    return int(gpu_memory_gb * GIB * DEVICE_FRACTION)


def check_memory_fit(recipe) -> MemoryFit:
    """Estimate `recipe`'s memory per rank; raise InputError (naming what to change) when a GPU recipe
    cannot fit, and return the estimate with a warning within 10% of a limit.

    An architecture that cannot be counted is not refused: the fit comes back unchecked, with a warning
    saying why (e.g. set model.reference_config).
    """
    on_gpu = recipe.cluster.gpus_per_node > 0
    limit = device_bytes(recipe.cluster.gpu_memory_gb) if on_gpu else None
    try:
        found = load_architecture(recipe.model)
    except UnknownArchitecture as e:
        return MemoryFit(None, "", limit, warning=f"memory fit not checked: {e}")
    check_layout(recipe, found.architecture, found.source)
    fit = _fit(recipe, found, limit)
    e = fit.estimate
    if e.engine_budget and e.engine_weights >= e.engine_budget:
        raise InputError(
            "generation.vllm.gpu_memory_utilization",
            _vllm_options(recipe).gpu_memory_utilization,
            message=(
                f"generation.vllm.gpu_memory_utilization: the vllm engine's share of the GPU, {_gib(e.engine_budget)}, "
                f"cannot hold its whole copy of the weights ({_gib(e.engine_weights)}, {_count(e.params)} parameters in "
                "the compute dtype) beside a KV cache: raise it, or run the engine over several GPUs (tensor "
                "parallel, not built yet), or generation.backend: hf"
            ),
        )
    if on_gpu and fit.estimate.device_total > limit:
        message = _refusal(recipe, fit, found)
        raise InputError("cluster.gpu_memory_gb", recipe.cluster.gpu_memory_gb, message=message)
    if fit.host_limit and fit.host_per_node > fit.host_limit:
        raise InputError("cluster.mem_gb", recipe.cluster.mem_gb, message=_host_refusal(recipe, fit))
    return _with_warning(fit)


def training_shape(recipe, arch: Architecture | None = None) -> tuple[TrainingShape, str]:
    """The per-rank shape of `recipe`'s biggest step, and the assumption it makes, in words. `arch` sizes
    the largest image a sample may hold where the recipe does not say (`image_bound`)."""
    t, d, p = recipe.train, recipe.data, recipe.parallel
    grpo = t.algorithm == "grpo"
    per_prompt = recipe.grpo.num_generations if grpo else 1
    steps_per_batch = recipe.grpo.inner_steps if grpo else 1
    micro_batches = max(1, t.global_batch_size // (p.dp * t.micro_batch_size) // steps_per_batch)
    seq_len = d.max_seq_len + (
        recipe.grpo.max_new_tokens if grpo else 0
    )  # a GRPO prompt fits max_seq_len, its responses add
    image, where = image_bound(recipe, arch)
    sequences = t.micro_batch_size * per_prompt
    if d.pack_tokens is not None and d.pack_by == "tokens":  # a micro-batch is a row of data.pack_tokens
        sequences = max(sequences, d.pack_tokens // d.max_seq_len)  # each with its image, at full length
    shape = TrainingShape(
        master_dtype=recipe.model.dtype,
        mixed_precision=p.mixed_precision,
        fsdp=p.sharded,
        dp=p.layout.shard_group,  # the ranks a copy of the state is sharded over (HSDP: dp_shard)
        cpu_offload=p.cpu_offload,
        activation_checkpointing=p.activation_checkpointing,
        reduce_every_micro_batch=p.reduce_every_micro_batch,
        optimizer=t.optimizer,
        sequences=sequences,
        micro_batches=micro_batches,
        seq_len=seq_len,
        image_size=image,
        on_gpu=recipe.cluster.gpus_per_node > 0,
        reference_model=grpo and recipe.grpo.kl_coef > 0 and recipe.model.lora is None,  # LoRA: adapters off
        generation_sequences=rollout_sequences(recipe),
        engine=grpo or validation_engine(recipe),
        engine_resident=grpo and not recipe.generation.sleeps_between_uses,
        refit_bucket=recipe.generation.refit_bucket_mb << 20,
        image_share=per_prompt,  # a GRPO prompt's responses read one encoding of its image
        scored_tokens=scored_tokens(recipe),
        # on a CPU rank the host is the device: the moves free nothing there
        offload_during_generation=p.offload_during_generation and recipe.cluster.gpus_per_node > 0,
        engine_budget=_engine_budget(recipe),
        tp=p.tp,
        pp=p.pp,
        sequence_parallel=p.sequence_parallel,
        trained_params=adapter_params(arch, recipe.model.lora) if arch is not None and recipe.model.lora else None,
    )
    seqs = f"{t.micro_batch_size} x {per_prompt}" if grpo else f"{sequences}"
    length = f"data.max_seq_len={d.max_seq_len}" + (f" + grpo.max_new_tokens={seq_len - d.max_seq_len}" if grpo else "")
    said = (
        f"{micro_batches} micro-batch(es) per step of {seqs} sequence(s) of {length} tokens, one {image} px image "
        f"{'per prompt, encoded once for its responses' if grpo else 'each'} ({where})"
    )
    if grpo:
        said += f"; the rollout generates {shape.generation_sequences} sequences in one call (the rank's whole step)"
    return shape, said


def rollout_sequences(recipe) -> int:
    """The sequences one generate call holds on a rank (0 without GRPO): `GrpoWorker.rollout` samples
    its replica's whole step at once (every prompt micro-batch of the step, each prompt
    `grpo.num_generations` times), not a micro-batch at a time; one replica per dp rank."""
    t = recipe.train
    if t.algorithm != "grpo":
        return 0
    prompts = t.global_batch_size // recipe.parallel.dp // t.micro_batch_size * t.micro_batch_size
    return prompts * recipe.grpo.num_generations


def validation_engine(recipe) -> bool:
    """Whether SFT's validation opens an engine with a whole copy of the weights on every rank: not where
    it generates with the sharded policy's own model (`Recipe.validates_with_the_policy`), whose
    gathers, a layer at a time, are those of a forward."""
    return recipe.train.val_samples > 0 and not recipe.validates_with_the_policy


def image_bound(recipe, arch: Architecture | None) -> tuple[int, str]:
    """(the side in px of the largest image a sample may hold, where that bound comes from): a synthetic
    set's size; else the square image whose tokens fill `data.max_seq_len` (a longer sample is cut or
    refused, data/task_encoder.py), which a user's high-resolution images may reach (Qwen2.5-VL's
    processor allows 16k tokens an image)."""
    d = recipe.data
    if d.synthetic is not None:
        return d.synthetic.image_size, "data.synthetic.image_size"
    patch = arch.vision.patch_size if arch is not None else 14
    side = math.isqrt(d.max_seq_len * PATCHES_PER_TOKEN) * patch
    return side, f"data.synthetic is unset: the largest image {d.max_seq_len} tokens (data.max_seq_len) hold"


def scored_tokens(recipe) -> int | None:
    """The most labelled tokens of a sequence (the positions the policy projects onto the vocabulary):
    GRPO's response bound, a synthetic CLEVR answer with its end of turn, or every token (None) for a
    user's SFT conversations, whose answers may be any length."""
    if recipe.train.algorithm == "grpo":
        return recipe.grpo.max_new_tokens
    if recipe.data.synthetic is not None:
        return SYNTHETIC_ANSWER_TOKENS
    return None


def _engine_budget(recipe) -> int:
    """The bytes a vLLM engine may take on its GPU (0 for other backends, and on a CPU run): its
    gpu_memory_utilization of what the device offers (its own process's CUDA context comes on top:
    memory.py, item 18)."""
    if recipe.generation.backend != "vllm" or not recipe.cluster.gpus_per_node:
        return 0
    return int(_vllm_options(recipe).gpu_memory_utilization * device_bytes(recipe.cluster.gpu_memory_gb))


def _vllm_options(recipe):
    from vlmrun.config.generation import VllmOptions

    return recipe.generation.vllm or VllmOptions()


def _fit(recipe, found: ArchitectureSource, limit: int | None) -> MemoryFit:
    shape, said = training_shape(recipe, found.architecture)
    c = recipe.cluster
    host_limit = c.mem_gb * GIB if (c.mem_gb and shape.on_gpu) else None
    peak = estimate(found.architecture, shape)
    if peak.stage is not None:  # tensor or pipeline parallel: the stage that peaks
        said += (
            f"; the peak is pipeline stage {peak.stage} of {shape.pp}, each rank holding 1/{shape.tp} of "
            f"its tensor-parallel tensors, {min(shape.pp - peak.stage, shape.micro_batches)} micro-batch(es) in flight"
        )
    if shape.trained_params is not None:
        said += "; " + _lora_savings(found.architecture, shape, peak)
    ranks = max(1, c.gpus_per_node)
    rate = _throughput(recipe, found.architecture, shape) if shape.on_gpu else None
    return MemoryFit(
        peak,
        found.source,
        limit,
        found.note,
        host_limit,
        ranks,
        warning=found.warning,
        assumption=said,
        throughput=rate,
    )


def _lora_savings(arch: Architecture, shape: TrainingShape, peak: MemoryEstimate) -> str:
    """What training only the adapters saves per rank, in words (the dry run prints it)."""
    full = estimate(arch, replace(shape, trained_params=None, reference_model=False))

    def state(e: MemoryEstimate) -> int:
        return e.gradients + e.optimizer + e.accumulated_gradients

    return (
        f"LoRA: {_count(shape.trained_params)} adapter parameters train ({100 * shape.trained_params / arch.total:.2f}% "
        f"of {_count(arch.total)}): gradients and optimizer state {_size(state(peak))} instead of "
        f"{_size(state(full))} per rank, {_size(state(full) - state(peak))} saved"
    )


def _throughput(recipe, arch: Architecture, shape: TrainingShape) -> ThroughputEstimate:
    compute = 2 if shape.mixed_precision == "bf16" or shape.master_dtype == "bfloat16" else 4
    return estimate_throughput(arch, recipe, compute_bytes=compute, scored=shape.scored_tokens)


def _with_warning(fit: MemoryFit) -> MemoryFit:
    e, near = fit.estimate, None
    if fit.limit and e.device_total > WARN_FRACTION * fit.limit:
        why = f"the estimate {_gib(e.device_total)} is within 10% of cluster.gpu_memory_gb ({_gib(fit.limit)})"
        near = f"{why}: the run may run out of GPU memory"
    elif fit.host_limit and fit.host_per_node > WARN_FRACTION * fit.host_limit:
        why = f"host memory {_gib(fit.host_per_node)} per node ({_host_words(fit)}) is within 10% of cluster.mem_gb"
        near = f"{why} ({_gib(fit.host_limit)})"
    return replace(fit, warning="; ".join(w for w in (fit.warning, near) if w) or None)


def _refusal(recipe, fit: MemoryFit, found: ArchitectureSource) -> str:
    e = fit.estimate
    parts = " + ".join(f"{name} {v / GIB:.1f}" for name, v in e.peak_terms().items())
    remedies = _remedies(recipe, found, e.device_total)
    lower = f"each of these lowers the estimate: {', '.join(remedies)}; or " if remedies else ""
    return (
        f"cluster.gpu_memory_gb: this run needs ~{_gib(e.device_total)} per GPU (end of the {e.peak_phase}), more than the "
        f"{_gib(fit.limit)} of cluster.gpu_memory_gb={recipe.cluster.gpu_memory_gb} ({_count(e.params)} "
        f"parameters, {fit.source}: {parts} GiB); {lower}bigger GPUs (cluster.gpu_memory_gb)"
    )


def _host_words(fit: MemoryFit) -> str:
    """What the node's host memory peak is, in words."""
    e, n = fit.estimate, fit.ranks_per_node
    if e.rollout_host and e.rollout_host >= e.load_host:
        return f"weights and optimizer state of {n} rank(s), moved there for the rollout"
    if e.offloaded and e.host_per_rank >= e.load_host:
        return f"weights, gradients and optimizer state of {n} rank(s), offloaded"
    how = "each its share of the weights' files" if e.load_sharded else "each the whole model"
    return f"{n} rank(s) loading the model, {how}" + (", with the offloaded state" if e.offloaded else "")


def _host_refusal(recipe, fit: MemoryFit) -> str:
    e = fit.estimate
    if e.offloaded and e.host_per_rank >= e.load_host:
        return (
            f"cluster.mem_gb: parallel.cpu_offload keeps ~{_gib(fit.host_per_node)} of weights, gradients and "
            f"optimizer state in host memory per node ({fit.ranks_per_node} ranks x {_gib(e.host_per_rank)}), "
            f"more than cluster.mem_gb={recipe.cluster.mem_gb}; raise cluster.mem_gb, or raise parallel.dp "
            "(more nodes), or model.dtype=bfloat16 (halves it, at the cost of bf16 master weights)"
        )
    if e.rollout_host and e.rollout_host >= e.load_host:
        return (
            f"cluster.mem_gb: parallel.offload_during_generation moves ~{_gib(fit.host_per_node)} of weights and "
            f"optimizer state to host memory per node for each rollout ({fit.ranks_per_node} ranks x "
            f"{_gib(e.rollout_host)}), more than cluster.mem_gb={recipe.cluster.mem_gb}; raise cluster.mem_gb, "
            "or raise parallel.dp (more nodes), or parallel.offload_during_generation=false"
        )
    sharded = recipe.parallel.sharded
    fix = "raise parallel.dp (more nodes)" if sharded else "parallel.fsdp=true (each rank reads only its share)"
    return (
        f"cluster.mem_gb: loading the model takes ~{_gib(fit.host_per_node)} of host memory per node "
        f"({fit.ranks_per_node} ranks x {_gib(e.host_peak_per_rank)}: {_host_words(fit)}), more than "
        f"cluster.mem_gb={recipe.cluster.mem_gb}; raise cluster.mem_gb, or {fix}"
    )


def _remedies(recipe, found: ArchitectureSource, total: int) -> list[str]:
    """The candidate changes that lower this estimate, each with the estimate it gives, lowest first.

    Each is applied to the recipe and estimated again; one the recipe refuses (e.g. a dp the global
    batch does not divide) or that does not lower the estimate is left out.
    """
    from vlmrun.config.load import set_dotted, validate

    lowered = []
    for changes, words in candidate_changes(recipe):
        raw = recipe.model_dump()
        for key, value in changes.items():
            set_dotted(raw, key, value)
        try:
            changed = validate(raw)
            check_layout(changed, found.architecture, found.source)  # a tp or pp the model cannot be cut into
        except InputError:
            continue
        after = estimate(found.architecture, training_shape(changed, found.architecture)[0]).device_total
        if after < total:
            lowered.append((after, f"{words} (-> {_gib(after)})"))
    return [words for _, words in sorted(lowered, key=lambda item: item[0])]


def _gib(n: int | None) -> str:
    return f"{(n or 0) / GIB:.1f} GiB"


def _size(n: int | None) -> str:
    n = n or 0
    return _gib(n) if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
