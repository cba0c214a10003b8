"""The SFT controller: one Ray actor that runs the step loop of SFT v1 or v2.

1. v1 (driver-fed): the controller owns the loader shards of all replicas, builds each step's
   micro-batches and ships them to the workers through Ray.
2. v2 (single controller, colocated loaders): the owner rank of each replica holds its own shard's
   loader (the topology mapper decides which); the controller sends "step" and receives metrics only.
3. Both read shard r of DP for replica r, and the loss is normalized by the step's global count of
   valid tokens, so on CPU with a fixed seed both loops give bitwise-identical losses.
4. A stop request (signal -> flag -> `request_stop`) is acted on at the next step boundary: every rank
   saves, and the run ends as STOPPED (resumable).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import ray

from vlmrun.distributed.topology import ParallelLayout, plan_placement
from vlmrun.errors import InputError
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import MetricsLog
from vlmrun.observe.wandb_sink import WandbSink
from vlmrun.policy import rng
from vlmrun.policy.hf import PolicyWorker
from vlmrun.algorithms.common.checkpoint import CheckpointStore
from vlmrun.algorithms.common.steps import plan_steps

log = logging.getLogger(__name__)


class SftController:
    def __init__(self, *, recipe_json: str, run_dir: str, attempt: int, model_dir: str, worker_threads: int = 1,
                 started_at: float | None = None):
        from vlmrun.config.recipe import Recipe

        self.recipe = Recipe.model_validate_json(recipe_json)
        self.recipe_json, self.model_dir, self.attempt = recipe_json, model_dir, attempt
        self.rd = RunDirectory(run_dir)
        self.worker_threads = worker_threads
        self._stop = threading.Event()
        self.stop_reason = ""
        self.save_times: list[float] = []
        self.started_at = started_at or time.time()

    def request_stop(self, reason: str = "signal") -> None:
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        r = self.recipe
        self.plan = plan_placement(ParallelLayout(dp=r.parallel.dp, tp=r.parallel.tp, pp=r.parallel.pp, cp=r.parallel.cp))
        from vlmrun.data.splits import split_size

        self.steps = plan_steps(r, split_size(r.data.path, r.data.split))
        self.store = CheckpointStore(self.rd.checkpoints(r), r.checkpoint.keep)
        self.metrics = MetricsLog(self.rd.metrics_file(r))
        self.wandb = WandbSink(mode=r.logger.wandb_mode, project=r.logger.wandb_project, run_dir=self.rd.path,
                               name=self.rd.path.name, run_id=_wandb_id(self.rd.path))
        self._start_workers()
        self._open_loaders()
        start_step, counters, notes = self._resume()
        first_step_at = None
        step = start_step
        for step in range(start_step + 1, self.steps.max_steps + 1):
            if self._stop.is_set():
                step -= 1
                self._save(step, counters)
                return self._outcome("STOPPED", step, f"stop requested ({self.stop_reason}); checkpointed at step {step}", notes)
            row = self._train_step(step, counters)
            if first_step_at is None:
                first_step_at = time.time()
                notes["first_step_s"] = round(first_step_at - self.started_at, 3)  # job start -> first step done
            if self._due(step, r.train.val_period):
                row |= self._validate()
                notes["final_val"] = {k: row[k] for k in row if k.startswith("val_")}
            self.metrics.append(row)
            self.wandb.log(row)
            if self._due(step, r.checkpoint.save_period) or self._stop.is_set():
                self._save(step, counters)
        if self._stop.is_set() and step < self.steps.max_steps:
            return self._outcome("STOPPED", step, f"stop requested ({self.stop_reason})", notes)
        return self._outcome("COMPLETED", step, f"finished {self.steps.max_steps} steps", notes)

    def _due(self, step: int, period: int) -> bool:
        return step == self.steps.max_steps or (period > 0 and step % period == 0)

    def _outcome(self, state: str, step: int, reason: str, notes: dict) -> dict:
        self.wandb.close()
        for w in self.workers:
            w.shutdown.remote()
        for loader in self.loaders.values():
            loader.close()
        return {"state": state, "last_step": step, "reason": reason, "max_steps": self.steps.max_steps,
                "checkpoint_save_s": self.save_times, "worker_nodes": self.worker_nodes,
                "ray_alive_nodes": sum(1 for n in ray.nodes() if n["Alive"]), **notes}

    # ---- set-up ----------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        """One actor per rank, placed by a placement group: rank i in bundle i, spread over the nodes."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = self.plan.layout.world_size
        gpus = 1 if self.recipe.cluster.gpus_per_node else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        nodes = self.recipe.cluster.nodes
        # One rank per node when ranks and nodes match (the 2-node dp=2 layout); else spread, packing allowed.
        strategy = "STRICT_SPREAD" if nodes > 1 and world == nodes else ("SPREAD" if nodes > 1 else "PACK")
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
        ray.get(self.pg.ready(), timeout=300)
        actor = ray.remote(PolicyWorker)
        self.workers = [
            actor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank)).remote(
                rank=rank, world_size=world, recipe_json=self.recipe_json, model_dir=self.model_dir,
                threads=self.worker_threads)
            for rank in range(world)
        ]
        self.worker_nodes = ray.get([w.node_address.remote() for w in self.workers])
        port = ray.get(self.workers[0].free_port.remote())
        ray.get([w.setup.remote(self.worker_nodes[0], port, self.steps.max_steps) for w in self.workers])

    def _open_loaders(self) -> None:
        self.loaders = {}
        if self.recipe.train.loop == "v2":
            ray.get([self.workers[s.owner_rank].attach_loader.remote(s.shard, s.num_shards, self.plan.placement_hash)
                     for s in self.plan.shards])
            return
        from vlmrun.data.loader import open_loader_shard

        for s in self.plan.shards:
            self.loaders[s.shard] = open_loader_shard(self.recipe, processor_dir=self.model_dir, shard=s.shard,
                                                      num_shards=s.num_shards, placement_hash=self.plan.placement_hash,
                                                      split=self.recipe.data.split)

    def _resume(self) -> tuple[int, dict, dict]:
        import torch

        rng.seed_all(self.recipe.train.seed)
        counters = {"consumed_samples": 0, "total_valid_tokens": 0}
        found, skipped = self.store.latest()
        notes = {"skipped_checkpoints": skipped} if skipped else {}
        if found is None:
            return 0, counters, notes
        meta = found.meta
        if meta["placement_hash"] != self.plan.placement_hash:
            raise InputError("parallel", self.plan.layout.describe(),
                             f"checkpoint {found.path} was written with layout {meta['layout']} "
                             f"(placement {meta['placement_hash']}), this run has {self.plan.layout.describe()} "
                             f"(placement {self.plan.placement_hash}); resume with the same layout")
        ray.get([w.load.remote(str(found.path)) for w in self.workers])
        for shard, loader in self.loaders.items():
            state = torch.load(found.path / "loader" / f"shard_{shard}.pt", weights_only=True)
            loader.load_state_dict(state["loader"])
        ctrl = torch.load(found.path / "controller.pt", weights_only=True)
        rng.set_rng_state(ctrl["rng"])
        counters = dict(ctrl["counters"])
        notes["resumed_from"] = found.step
        log.info("resumed from %s", found.path)
        return found.step, counters, notes

    # ---- one step --------------------------------------------------------------------------------
    def _train_step(self, step: int, counters: dict) -> dict:
        t0 = time.perf_counter()
        n_micro = self.steps.micro_batches_per_replica
        if self.recipe.train.loop == "v1":
            refs, loader_s = [], 0.0
            for s in self.plan.shards:
                t1 = time.perf_counter()
                batches = [self.loaders[s.shard].next_batch() for _ in range(n_micro)]
                loader_s = max(loader_s, time.perf_counter() - t1)
                refs.append(self.workers[s.owner_rank].train_step.remote(step, micro_batches=batches))
            results = ray.get(refs)
        else:
            results = ray.get([w.train_step.remote(step, n_micro=n_micro) for w in self.workers])
            loader_s = max(r["loader_s"] for r in results)
        dt = time.perf_counter() - t0
        head = results[0]
        samples = self.steps.global_batch_size
        counters["consumed_samples"] += samples
        counters["total_valid_tokens"] += head["valid_tokens"]
        return {
            "step": step, "attempt": self.attempt, "epoch": self.steps.epoch_of(step),
            "loss": head["loss"], "grad_norm": head["grad_norm"], "lr": head["lr"],
            "valid_tokens": head["valid_tokens"], "consumed_samples": counters["consumed_samples"],
            "sample_ids": [i for r in results for i in r["sample_ids"]],
            "step_time_s": round(dt, 4), "loader_latency_max_s": round(loader_s, 4),
            "tokens_per_s": round(head["valid_tokens"] / dt, 2), "samples_per_s": round(samples / dt, 2),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results), "time": round(time.time(), 3),
        }

    def _validate(self) -> dict:
        r = self.recipe
        if r.train.val_samples <= 0:
            return {}
        if not hasattr(self, "_val"):
            from vlmrun.data.loader import val_batches

            self._val = val_batches(r, processor_dir=self.model_dir, samples=r.train.val_samples,
                                    batch_size=max(1, r.train.micro_batch_size))
        loss_b, prompt_b = self._val
        n = len(self.workers)
        parts = ray.get([w.validate.remote(loss_b[i::n], prompt_b[i::n]) for i, w in enumerate(self.workers)])
        nll, tokens, correct, answered = [sum(p[k] for p in parts) for k in range(4)]
        return {"val_loss": nll / max(tokens, 1), "val_accuracy": correct / max(answered, 1), "val_samples": int(answered),
                "val_majority_baseline": majority_share([a for b in prompt_b for a in b.answers])}

    def _save(self, step: int, counters: dict) -> None:
        import torch

        if step <= 0 or (self.store.complete() and self.store.complete()[-1][0] == step):
            return
        t0 = time.perf_counter()
        tmp = self.store.begin(step)
        files = []
        # Replicas hold identical weights and optimizer state: rank 0 writes them, every rank its RNG.
        for part in ray.get([w.save.remote(str(tmp), with_model=(i == 0)) for i, w in enumerate(self.workers)]):
            files += part
        for shard, loader in self.loaders.items():
            (tmp / "loader").mkdir(exist_ok=True)
            torch.save({"loader": loader.state_dict(), "plane": {}}, tmp / "loader" / f"shard_{shard}.pt")
            files.append(f"loader/shard_{shard}.pt")
        torch.save({"rng": rng.rng_state(), "counters": counters}, tmp / "controller.pt")
        files.append("controller.pt")
        meta = {"placement_hash": self.plan.placement_hash, "layout": self.plan.layout.describe(),
                "loop": self.recipe.train.loop, "attempt": self.attempt, "counters": counters}
        path = self.store.finish(step, tmp, meta, files)
        self.save_times.append(round(time.perf_counter() - t0, 4))
        log.info("saved %s in %.2fs", path, self.save_times[-1])


def _wandb_id(run_dir: Path) -> str:
    """One wandb run per run directory, so resumed attempts append to it."""
    import hashlib

    return hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]


def majority_share(answers: list[str]) -> float:
    """Accuracy of always answering the most common answer: the bar a model must beat."""
    from collections import Counter

    return Counter(answers).most_common(1)[0][1] / len(answers) if answers else 0.0
