"""PolicyWorker: one Ray actor per rank of the model (backend `hf`: transformers + torch.distributed).

Each worker owns its replica's model, optimizer and LR schedule, runs forward/backward over the step's
micro-batches, sums gradients across data-parallel ranks, steps, and saves/loads its part of a
checkpoint. In SFT v2 the owner rank of each replica also owns that replica's loader shard and moves
the step's batch through the process-local data plane; in v1 the batches arrive from the driver.
"""

from __future__ import annotations

import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vlmrun.data.batch import Batch
from vlmrun.plane.local import LocalDataPlane
from vlmrun.policy import rng
from vlmrun.policy.grad_sync import all_reduce_gradients, all_reduce_sum
from vlmrun.policy.loss import nll_sum, valid_tokens


class PolicyWorker:
    def __init__(self, *, rank: int, world_size: int, recipe_json: str, model_dir: str, threads: int = 1):
        from vlmrun.config.recipe import Recipe

        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.recipe = Recipe.model_validate_json(recipe_json)
        self.model_dir = model_dir
        self.loader = None
        self.plane = LocalDataPlane()

    # ---- set-up -------------------------------------------------------------------------------
    def node_address(self) -> str:
        """The address other ranks reach this one at (127.0.0.1 on the embedded default)."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, max_steps: int) -> dict:
        """Join the process group, load the model, build optimizer and schedule (identical on all ranks)."""
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from vlmrun.policy.lr_schedule import lr_factor

        t = self.recipe.train
        if self.world_size > 1:
            dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(minutes=10))
        rng.seed_all(t.seed + self.rank)
        dtype = torch.bfloat16 if self.recipe.model.dtype == "bfloat16" else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if t.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
                                               foreach=False)
        else:
            self.optimizer = torch.optim.SGD(self.params, lr=t.lr, weight_decay=t.weight_decay, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, max_steps=max_steps, warmup_steps=t.warmup_steps,
                                                schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio))
        return {"rank": self.rank, "params": sum(p.numel() for p in self.params)}

    def attach_loader(self, shard: int, num_shards: int, placement_hash: str) -> None:
        """SFT v2: this rank owns loader shard `shard` of its replica."""
        from vlmrun.data.loader import open_loader_shard

        self.loader = open_loader_shard(self.recipe, processor_dir=self.model_dir, shard=shard, num_shards=num_shards,
                                        placement_hash=placement_hash, split=self.recipe.data.split)

    # ---- one optimizer step --------------------------------------------------------------------
    def train_step(self, step: int, micro_batches: list[Batch] | None = None, n_micro: int = 0) -> dict:
        """Run one step. v1 passes `micro_batches`; v2 passes `n_micro` and the owned loader fills the plane."""
        loader_s = 0.0
        if micro_batches is None:
            partition = f"step-{step}"
            t0 = time.perf_counter()
            try:
                batches = [self.loader.next_batch() for _ in range(n_micro)]
                self.plane.put(partition, batches, [i for b in batches for i in b.sample_ids])
                self.plane.commit(partition)
            except BaseException:
                self.plane.abort(partition)
                raise
            loader_s = time.perf_counter() - t0
            micro_batches = self.plane.get(partition)
            self.plane.clear(partition)
        t0 = time.perf_counter()
        local_tokens = sum(valid_tokens(b.labels) for b in micro_batches)
        (global_tokens,) = all_reduce_sum([float(local_tokens)])
        denom = max(global_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        local_nll = 0.0
        for b in micro_batches:
            out = self.model(**b.model_inputs(), use_cache=False)
            nll = nll_sum(out.logits, b.labels)
            (nll / denom).backward()
            local_nll += float(nll.detach())
        all_reduce_gradients(self.params)
        clip = self.recipe.train.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        (total_nll,) = all_reduce_sum([local_nll])
        return {"loss": total_nll / denom, "grad_norm": float(grad_norm), "lr": lr, "valid_tokens": int(global_tokens),
                "sample_ids": [i for b in micro_batches for i in b.sample_ids], "loader_s": loader_s,
                "compute_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probability of each next token under the current weights, [B, T-1]; 0 where labels are ignored."""
        from vlmrun.policy.loss import token_logprobs

        was_training = self.model.training
        self.model.eval()
        try:
            return token_logprobs(self.model(**batch.model_inputs(), use_cache=False).logits, batch.labels)
        finally:
            self.model.train(was_training)

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, val_batches: list, answer_batches: list, max_new_tokens: int = 4) -> list[float]:
        """Summed (nll, tokens, correct, answered) over this rank's val batches; the caller all-reduces."""
        from vlmrun.policy.evaluate import score_batches

        return score_batches(self.model, self.tokenizer, val_batches, answer_batches, max_new_tokens=max_new_tokens)

    def reduce(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values)

    # ---- checkpoint ----------------------------------------------------------------------------
    def save(self, directory: str, *, with_model: bool) -> list[str]:
        """Write this rank's part of a checkpoint into `directory`; returns the files written."""
        d = Path(directory)
        written = []
        if with_model:
            torch.save(self.model.state_dict(), d / "model.pt")
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       d / "optim.pt")
            written += ["model.pt", "optim.pt"]
        (d / "rng").mkdir(exist_ok=True)
        torch.save(rng.rng_state(), d / "rng" / f"rank_{self.rank}.pt")
        written.append(f"rng/rank_{self.rank}.pt")
        if self.loader is not None:
            (d / "loader").mkdir(exist_ok=True)
            name = f"loader/shard_{self.loader.shard}.pt"
            torch.save({"loader": self.loader.state_dict(), "plane": self.plane.state_dict()}, d / name)
            written.append(name)
        return written

    def load(self, directory: str) -> None:
        d = Path(directory)
        self.model.load_state_dict(torch.load(d / "model.pt", weights_only=True))
        opt = torch.load(d / "optim.pt", weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        rng.set_rng_state(torch.load(d / "rng" / f"rank_{self.rank}.pt", weights_only=True))
        if self.loader is not None:
            state = torch.load(d / "loader" / f"shard_{self.loader.shard}.pt", weights_only=True)
            self.loader.load_state_dict(state["loader"])
            self.plane.load_state_dict(state["plane"])

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def peak_rss_mb() -> float:
    """Peak RSS of this process and its loader worker children, in MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024.0, 1) if os.name == "posix" else 0.0
