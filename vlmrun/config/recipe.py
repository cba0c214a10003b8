"""The recipe: every section of a run, composed from the components' own config models."""

from __future__ import annotations

from pydantic import Field, model_validator

from vlmrun.config.backends import POLICY_BACKENDS, policy_refusal
from vlmrun.config.cluster import ClusterConfig
from vlmrun.config.data import DataConfig
from vlmrun.config.data_plane import DataPlaneConfig
from vlmrun.config.dtype import compute_dtype
from vlmrun.config.families import FAMILIES, families_that
from vlmrun.config.generation import GenerationConfig
from vlmrun.config.grpo import BUILTIN_REWARDS, GrpoConfig
from vlmrun.config.logger import LoggerConfig
from vlmrun.config.model import ModelConfig
from vlmrun.config.parallel import ParallelConfig
from vlmrun.config.section import Section
from vlmrun.config.train import CheckpointConfig, TrainConfig


class CrossFieldError(ValueError):
    """A check that involves several fields; `field` is the one the user should change."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(allowed)


class Recipe(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        if self.parallel.fsdp is None:  # the default: shard on GPUs (where the backend shards so), replicate on CPU
            shards = POLICY_BACKENDS[self.model.backend].capabilities.fsdp is None
            self.parallel = self.parallel.model_copy(update={"fsdp": self.cluster.gpus_per_node > 0 and shards})
        t, p = self.train, self.parallel
        if t.global_batch_size % (p.dp * t.micro_batch_size):
            raise CrossFieldError(
                "train.global_batch_size",
                t.global_batch_size,
                f"must be divisible by parallel.dp x train.micro_batch_size = {p.dp} x {t.micro_batch_size}",
            )
        if self.data.family is not None and self.data.family != self.model.family:
            raise CrossFieldError("data.family", self.data.family, f"must match model.family ({self.model.family!r})")
        if (refused := policy_refusal(self)) is not None:
            raise CrossFieldError(*refused)
        if p.cpu_offload and not self.cluster.gpus_per_node:
            raise CrossFieldError(
                "parallel.cpu_offload",
                True,
                "needs GPUs (cluster.gpus_per_node > 0): it moves GPU-resident state to host memory, "
                "where a CPU run keeps it already",
            )
        if p.offload_during_generation and self.train.algorithm != "grpo":
            raise CrossFieldError(
                "parallel.offload_during_generation",
                True,
                f"moves the policy off the device around GRPO's rollouts; train.algorithm is {self.train.algorithm!r}",
            )
        if p.offload_during_generation and p.cpu_offload:
            raise CrossFieldError(
                "parallel.offload_during_generation",
                True,
                "with parallel.cpu_offload: true the policy's state lives in host memory already: set one of them",
            )
        _check_generation(self)
        if p.dp_shard is not None and p.dp % p.dp_shard:
            raise CrossFieldError(
                "parallel.dp_shard", p.dp_shard, f"must divide parallel.dp = {p.dp} (HSDP: dp / dp_shard replicas)"
            )
        if not p.fsdp:
            for field, value, default in (
                ("dp_shard", p.dp_shard, None),
                ("mixed_precision", p.mixed_precision, "none"),
                ("cpu_offload", p.cpu_offload, False),
                ("reduce_every_micro_batch", p.reduce_every_micro_batch, False),
            ):
                if value != default:
                    raise CrossFieldError(
                        f"parallel.{field}", value, "needs parallel.fsdp: true (an FSDP2 setting; replicas hold it all)"
                    )
        c = self.cluster
        if self.model.attn_implementation == "flash_attention_2":
            computes = compute_dtype(self.model.dtype, p.mixed_precision)
            if not c.gpus_per_node or computes not in ("bfloat16", "float16"):
                raise CrossFieldError(
                    "model.attn_implementation",
                    "flash_attention_2",
                    "needs GPUs (cluster.gpus_per_node > 0) computing in bf16 or fp16 (model.dtype, or "
                    f"parallel.mixed_precision: bf16; here {computes}); sdpa runs everywhere",
                )
        if c.gpus_per_node and p.world_size != c.gpus:
            raise CrossFieldError(
                "parallel.dp",
                p.dp,
                f"dp x tp x pp x cp = {p.world_size} must equal the allocation's GPUs: "
                f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} = {c.gpus}",
            )
        if (
            c.gpus_per_node
            and p.dp_shard
            and c.nodes > 1
            and c.gpus_per_node % p.dp_shard
            and p.dp_shard % c.gpus_per_node
        ):
            raise CrossFieldError(
                "parallel.dp_shard",
                p.dp_shard,
                f"must divide cluster.gpus_per_node = {c.gpus_per_node} or be a multiple of it: a shard group "
                "spans whole nodes or stays inside one, never part of two",
            )
        if not c.gpus_per_node and p.world_size > c.nodes * c.cpus_per_node:
            raise CrossFieldError(
                "parallel.dp",
                p.dp,
                f"a CPU run needs one CPU per rank: at most cluster.nodes x cluster.cpus_per_node = "
                f"{c.nodes * c.cpus_per_node} ranks",
            )
        if self.data.pack_tokens is not None:
            _check_packing(self)
        elif self.data.pack_by != "samples":
            raise CrossFieldError(
                "data.pack_by", self.data.pack_by, "needs data.pack_tokens: the row a micro-batch fills"
            )
        if self.train.algorithm == "grpo":
            _check_grpo(self)
        else:
            _check_sft(self)
        return self

    @property
    def family(self) -> str:
        return self.data.family or self.model.family

    @property
    def validates_with_the_policy(self) -> bool:
        """SFT on GPUs with a sharded hf policy answers its validation prompts with the policy's own model,
        a layer gathered at a time, instead of an engine's whole copy of the weights on every rank
        (algorithms/common/worker.py); elsewhere an engine is opened for the pass."""
        return (
            self.train.algorithm != "grpo"
            and self.cluster.gpus_per_node > 0
            and self.parallel.sharded
            and self.model.backend == "hf"
            and self.generation.backend == "hf"
        )


def _check_generation(r: Recipe) -> None:
    g = r.generation
    if g.vllm is not None and g.backend != "vllm":
        raise CrossFieldError("generation.vllm", "set", f"applies to generation.backend: vllm (here {g.backend!r})")
    if g.backend != "vllm":
        return
    if r.cluster.gpus_per_node and g.vllm is not None and g.vllm.kv_cache_memory_bytes is not None:
        raise CrossFieldError(
            "generation.vllm.kv_cache_memory_bytes",
            g.vllm.kv_cache_memory_bytes,
            "applies to a CPU run; on a GPU the engine's KV cache is what generation.vllm.gpu_memory_utilization "
            "leaves, which the memory check counts",
        )
    if r.train.algorithm != "grpo":
        raise CrossFieldError(
            "generation.backend",
            "vllm",
            "serves GRPO's rollouts; an SFT run generates only for validation, where an engine started for "
            "each pass costs more than it saves: set generation.backend: hf",
        )
    if (why := FAMILIES[r.family].capabilities.vllm) is not None:
        raise CrossFieldError(
            "generation.backend",
            "vllm",
            f"runs model.family {', '.join(families_that('vllm'))} here, not {r.family!r} ({why}): "
            "set generation.backend: hf",
        )
    longest = r.data.max_seq_len + r.grpo.max_new_tokens
    if g.vllm is not None and g.vllm.max_model_len is not None and g.vllm.max_model_len < longest:
        raise CrossFieldError(
            "generation.vllm.max_model_len",
            g.vllm.max_model_len,
            f"must hold a prompt and its response: at least data.max_seq_len + grpo.max_new_tokens = {longest}",
        )


def _check_packing(r: Recipe) -> None:
    d = r.data
    if (why := FAMILIES[r.family].capabilities.packing) is not None:
        raise CrossFieldError("data.pack_tokens", d.pack_tokens, f"cannot pack model.family {r.family!r}: {why}")
    if r.train.algorithm == "grpo":  # a sequence is a prompt (at most data.max_seq_len) and its response
        longest, what = d.max_seq_len + r.grpo.max_new_tokens, "data.max_seq_len + grpo.max_new_tokens"
    else:
        longest, what = d.max_seq_len, "data.max_seq_len"
    if d.pack_by == "tokens" and r.train.algorithm == "grpo" and r.grpo.inner_steps > 1:
        raise CrossFieldError(
            "data.pack_by",
            "tokens",
            f"needs grpo.inner_steps: 1 (here {r.grpo.inner_steps}: the inner steps split a step's micro-batches "
            "evenly, which a token budget does not keep)",
        )
    if d.pack_tokens < longest:
        raise CrossFieldError(
            "data.pack_tokens", d.pack_tokens, f"must be at least {what} = {longest}: every sequence must fit a row"
        )


def _check_sft(r: Recipe) -> None:
    """SFT moves its batches through the process-local plane (loop v2) or the driver (loop v1)."""
    if r.data_plane.impl != "local":
        raise CrossFieldError(
            "data_plane.impl", r.data_plane.impl, "SFT runs with 'local' (the transfer_queue plane serves GRPO)"
        )
    if not r.data_plane.enabled:
        raise CrossFieldError(
            "data_plane.enabled", False, "SFT chooses its path with train.loop: v1 (driver-fed) or v2 (the plane)"
        )


def _check_grpo(r: Recipe) -> None:
    t, g = r.train, r.grpo
    seen: dict[str, int] = {}
    for i, term in enumerate(g.rewards):
        if ":" not in term.fn and term.fn not in BUILTIN_REWARDS:
            raise CrossFieldError(
                f"grpo.rewards[{i}].fn",
                term.fn,
                f"a built-in reward ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function'",
            )
        if term.label in seen:
            raise CrossFieldError(
                f"grpo.rewards[{i}].name",
                term.label,
                f"grpo.rewards[{seen[term.label]}] has the same name: give each term its own `name`",
            )
        seen[term.label] = i
    lora = r.model.lora
    if lora is not None and lora.dropout > 0:  # the step's forward would drop what the scoring forward kept
        raise CrossFieldError(
            "model.lora.dropout",
            lora.dropout,
            "0 with GRPO: its old and new log-probs must come from the same forward (probs_ratio exactly 1 "
            "with one inner step), which adapter dropout in the training forward breaks",
        )
    micro = t.global_batch_size // (r.parallel.dp * t.micro_batch_size)
    if micro % g.inner_steps:
        raise CrossFieldError(
            "grpo.inner_steps",
            g.inner_steps,
            f"must divide the micro-batches each replica takes per step: train.global_batch_size / "
            f"(parallel.dp x train.micro_batch_size) = {t.global_batch_size} / "
            f"({r.parallel.dp} x {t.micro_batch_size}) = {micro}",
        )
