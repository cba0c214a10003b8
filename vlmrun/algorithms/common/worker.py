"""The rank worker every algorithm's per-rank actor extends: what SFT and GRPO ranks hold and do alike.

1. Construction: the rank's host side first (its malloc thresholds, policy/host_memory.py; a GPU rank
   computes on its share of the node's CPUs, `cluster.threads_per_gpu_rank`: the host's part of its step,
   AdamW over offloaded state included, would crawl on one thread, while a CPU rank keeps the one thread
   its CPU was given), then the rank's policy (the recipe's `model.backend`) and, when the algorithm
   generates (GRPO) and this rank owns its replica, its generation engine (`generation.backend`), on the
   rank's GPU when it has one, in the compute dtype, refit from the policy in memory: both opened by
   rank_backends.py, as `vlmrun eval` opens them. A replica of several ranks (tensor or pipeline
   parallel) has one engine, on its owner rank; its other ranks take part in every refit (collective)
   and generate nothing.
2. `setup`: the process group and the policy, then the engine and the tokenizer; for a replica of
   several ranks, its feed (distributed/replica_feed.py): what the owner reads, the others get.
3. `attach_loader`: the loader shard this rank owns (`open_train_shard`, the one way a loop opens one).
4. `validate`: this rank's replica's share of a validation pass (validation.py), with the algorithm's
   engine, or, for an algorithm that has none (SFT), an engine opened for the pass and released after
   it (on the replica's owner): a second copy of the weights must not sit beside the training state
   for the whole run. On GPUs with a sharded policy (`Recipe.validates_with_the_policy`) that engine
   generates with the policy's own model: not even for the pass does a rank hold a whole copy (a 30B
   model's would be ~62 GiB of each GPU).
5. Checkpoints: `save` writes the policy's state (`PendingCheckpoint.write_policy`), this rank's RNG,
   the owned loader shard's position and what the algorithm adds (`_save_own`); `load` reads them back.

Subclasses add their stages; `needs_generator` and `_save_own` / `_load_own` are their hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vlmrun.algorithms.common.rank_backends import open_rank_engine, open_rank_policy, rank_threads
from vlmrun.algorithms.common.shards import open_train_shard
from vlmrun.algorithms.common.validation import (
    ValidationScore,
    ValidationSet,
    ValidationShare,
    evaluate,
    response_texts,
    validation_shares,
)
from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, PolicyState, Storage
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.checkpoint.write import PendingCheckpoint
from vlmrun.distributed.replica_feed import ReplicaFeed
from vlmrun.distributed.worker_group import RankActor
from vlmrun.errors import InputError
from vlmrun.generation.interface import GenerationBackend
from vlmrun.policy import rng
from vlmrun.policy.interface import PolicyBackend


class RankWorker(RankActor):
    """Rank `rank` of `world_size` of the run of `recipe_json`, its model from `model_dir`; `replica`
    is its data-parallel replica (the generation engine's sampling stream), `owner` whether it is the
    replica's owner rank (the one that holds the replica's loader shard and sampling stream)."""

    #: Whether the algorithm itself generates (GRPO); else an engine is opened only for validation.
    needs_generator = False

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        recipe_json: str,
        model_dir: str,
        threads: int = 1,
        replica: int = 0,
        owner: bool = True,
    ):
        import torch

        from vlmrun.config.recipe import Recipe
        from vlmrun.policy.host_memory import keep_near_live
        from vlmrun.startup import freeze_imports

        freeze_imports()  # the imports are done; set-up's own collection walks only what set-up makes
        keep_near_live()
        r = Recipe.model_validate_json(recipe_json)
        threads = rank_threads(r, threads)
        torch.set_num_threads(threads)
        self.rank, self.replica, self.owner, self.threads = rank, replica, owner, threads
        self.recipe = r
        self.model_dir = model_dir
        self.policy: PolicyBackend = open_rank_policy(
            r, model_dir, rank=rank, world_size=world_size, parallel=r.parallel, gpus=r.cluster.gpus_per_node > 0
        )
        engine = self.needs_generator and owner  # one engine per replica, on its owner
        self.generator: GenerationBackend | None = self._open_engine() if engine else None
        self.refit_bytes = r.generation.refit_bucket_mb << 20
        self.loader = None
        self.feed: ReplicaFeed | None = None
        self._writing = None  # the policy's checkpoint write in the background (checkpoint.async_save)
        self._checkpoint_group = None

    def _open_engine(self) -> GenerationBackend:
        """A generation engine of this rank's replica, on the rank's GPU (Ray made it cuda:0) when it has one."""
        gpus = self.recipe.cluster.gpus_per_node > 0
        return open_rank_engine(self.recipe, self.model_dir, replica=self.replica, gpus=gpus, threads=self.threads)

    def setup(self, master_addr: str, master_port: int, max_steps: int, weights: str = "load") -> dict:
        """`weights`: "checkpoint" when a checkpoint's load follows (a resume): the policy reads none of
        the model directory's weights."""
        import torch.distributed as dist
        from transformers import AutoTokenizer

        info = self.policy.setup(master_addr=master_addr, master_port=master_port, max_steps=max_steps, weights=weights)
        self.image_token_id = self.generator.setup()["image_token_id"] if self.generator is not None else None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if dist.is_initialized():
            # collective, every rank at once: a background write's or restore's collectives (a sharded
            # policy's) go over a group of their own, never interleaved with the steps'
            self._checkpoint_group = dist.new_group(backend="gloo")
            self.feed = ReplicaFeed.for_layout(self.recipe.parallel.layout, self.rank)
        return info

    def from_owner(self, value):
        """The replica owner's `value` on every rank of the replica (itself where the replica is one rank)."""
        return value if self.feed is None else self.feed.share(value)

    def most_over_ranks(self, count: int) -> int:
        """The largest `count` any rank passes (a collective over the steps' process group: every rank
        calls it at the same point), e.g. how many micro-batches a step takes (data.pack_by: tokens)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return count
        most = torch.tensor([count])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def attach_loader(self, shard: int, num_shards: int, placement_hash: str, loader_format: int) -> None:
        """This rank owns loader shard `shard` of `num_shards` (its replica's), of the run's loader format."""
        self.loader = open_train_shard(
            self.recipe,
            self.model_dir,
            shard=shard,
            num_shards=num_shards,
            placement_hash=placement_hash,
            loader_format=loader_format,
        )

    def val_set(self, samples: int, batch_size: int, ranks: int) -> ValidationSet:
        """The recipe's validation set (`val_batches`: the first `samples` usable val samples as loss and
        prompt batches), read here and cut into the shares of `ranks` replicas, each put into Ray's object
        store: the controller hands each rank its replica's share's reference, so the batches (tensors) go from
        here to the ranks and never through the controller, which holds no torch."""
        import ray

        from vlmrun.data.loader import val_batches

        loss, prompts, dropped = val_batches(
            self.recipe, processor_dir=self.model_dir, samples=samples, batch_size=batch_size
        )
        shares = [ray.put(share) for share in validation_shares(loss, prompts, ranks)]
        return ValidationSet(shares, [a for b in prompts for a in b.answers], dropped, samples)

    def validate(self, share: ValidationShare) -> ValidationScore:
        """This rank's score of its replica's share of the val batches (collective: every rank calls it);
        answers come from the replica's owner, which the controller takes the score of."""
        with self._validation_engine() as engine:
            return evaluate(
                share, policy=self.policy, generator=engine, decode=self._decode, refit_bytes=self.refit_bytes
            )

    @contextlib.contextmanager
    def _validation_engine(self) -> Iterator[GenerationBackend | None]:
        """The algorithm's own engine, or one that lives only for this pass (module doc); None on a
        rank that does not own its replica."""
        if not self.owner:
            yield None
            return
        if self.generator is not None:
            yield self.generator
            if self.recipe.generation.sleeps_between_uses:
                self.generator.release_weights()
            return
        shared = self.policy.generation_model() if self.recipe.validates_with_the_policy else None
        gpus = self.recipe.cluster.gpus_per_node > 0
        engine = open_rank_engine(
            self.recipe, self.model_dir, replica=self.replica, gpus=gpus, threads=self.threads, policy_model=shared
        )
        engine.setup()
        try:
            yield engine
        finally:
            engine.shutdown()

    def _decode(self, rollouts) -> list[str]:
        """The texts of the rollouts' responses, special tokens dropped."""
        return response_texts(self.tokenizer, rollouts)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, pending: PendingCheckpoint, background: bool = False) -> dict[str, dict]:
        """Write this rank's parts into `pending` (collective when the policy is sharded); returns
        {file: digest} of what this rank wrote. With `background` the policy's state is copied and
        written on a thread while the next steps train: its digests come from `save_done`."""
        state = self.policy.checkpoint_state()
        if background:
            self._writing = pending.start_policy_write(state, rank=self.rank, group=self._checkpoint_group)
            written = {}
        else:
            self._writing = None
            written = pending.write_policy(state, rank=self.rank)
        written |= pending.write("rng", rng.rng_state(), index=self.rank)
        written |= self._save_own(pending)
        if self.loader is not None:
            written |= pending.write("loader", self.loader.state_dict(), index=self.loader.shard)
        return written

    def load_model_weights(self) -> None:
        """The policy's weights from the model itself after all (setup allocated them for a checkpoint
        that turned out damaged, with no valid one left): as a cold start has them."""
        self.policy.load_model_weights()

    def save_done(self, wait: bool = False) -> dict[str, dict] | None:
        """{file: digest} of the background policy write `save` began, once it is written (None while it
        runs, unless `wait`); raises what the write raised. Asked again, the same answer."""
        if self._writing is None:
            return {}
        if not wait and not self._writing.done():
            return None
        return self._writing.result()

    def load(self, checkpoint: Checkpoint, restart_data: bool = False, rng_rank: int | None = None) -> None:
        """Restore this rank's parts; with `restart_data` (another dp wrote it) only the policy's.
        InputError when the checkpoint's policy was written in the other layout (parallel.fsdp) or by the
        other backend (model.backend). `rng_rank`: the rank whose saved RNG this rank takes (default its
        own; another layout's ranks: its replica owner's)."""
        state = self.policy.checkpoint_state()
        if checkpoint.policy_storage is not state.storage:
            raise _storage_refusal(checkpoint, state.storage, self.recipe)
        weights = PolicyState(state.storage, {MODEL_PART: state.parts[MODEL_PART]})
        self.policy.load_checkpoint_state(checkpoint.read_policy(weights))
        rest = PolicyState(state.storage, {OPTIMIZER_PART: state.parts[OPTIMIZER_PART]})
        # the optimizer part (AdamW's moments: 2/3 of the bytes) while the first step's forward runs
        self.policy.load_checkpoint_state_later(lambda: checkpoint.read_policy(rest, group=self._checkpoint_group))
        if restart_data:
            return
        rng.set_rng_state(checkpoint.read("rng", index=self.rank if rng_rank is None else rng_rank))
        self._load_own(checkpoint)
        if self.loader is not None:
            self.loader.load_state_dict(checkpoint.read("loader", index=self.loader.shard))

    def _save_own(self, pending: PendingCheckpoint) -> dict[str, dict]:
        """The algorithm's own parts of this rank (none by default)."""
        return {}

    def _load_own(self, checkpoint: Checkpoint) -> None:
        """Restore what `_save_own` wrote."""

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.generator is not None:
            self.generator.shutdown()
        self.policy.shutdown()


def _storage_refusal(checkpoint: Checkpoint, storage: Storage, recipe) -> InputError:
    """The resume of a checkpoint whose policy was stored another way, refused naming the field."""
    written = checkpoint.policy_storage
    if Storage.PIECES in (written, storage):
        backend = "megatron" if written is Storage.PIECES else "hf"
        return InputError(
            "model.backend",
            recipe.model.backend,
            message=f"model.backend: checkpoint {checkpoint.path} was written by model.backend {backend}; "
            f"resume with model.backend: {backend}",
        )
    fsdp = "true" if written is Storage.SHARDED else "false"
    return InputError(
        "parallel.fsdp",
        recipe.parallel.fsdp,
        message=f"parallel.fsdp: checkpoint {checkpoint.path} was written with parallel.fsdp: {fsdp}; "
        f"resume with parallel.fsdp: {fsdp}",
    )
