"""The SFT controller: one Ray actor that runs the step loop of SFT v1 or v2.

1. v1 (driver-fed): the controller owns the loader shards of all replicas, builds each step's
   micro-batches and ships each replica its shard's (`WorkerGroup.submit_replica`).
2. v2 (single controller, colocated loaders): the owner rank of each replica holds its own shard's
   loader (the topology mapper decides which); the controller sends "step" and receives metrics only.
3. Both read shard r of DP for replica r, and the loss is normalized by the step's global count of
   valid tokens, so on CPU with a fixed seed both loops give bitwise-identical losses.
4. A stop request (signal -> flag -> `request_stop`) is acted on at the next step boundary: every rank
   saves, and the run ends as STOPPED (resumable).
5. The controller talks to the ranks only through the worker group's dispatch, and to checkpoints
   only through the checkpoint store (parts: controller, and each loader shard in v1).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import ray

from vlmrun.algorithms.common.checkpoint import CheckpointStore
from vlmrun.algorithms.common.steps import plan_steps
from vlmrun.algorithms.sft.worker import SftWorker
from vlmrun.distributed.topology import plan_placement
from vlmrun.distributed.worker_group import Placement, WorkerGroup
from vlmrun.errors import InputError
from vlmrun.observe.wandb_sink import WandbSink
from vlmrun.policy import rng
from vlmrun.run.directory import RunDirectory
from vlmrun.run.metrics import MetricsLog
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.state import State

log = logging.getLogger(__name__)


class SftController:
    def __init__(
        self,
        *,
        recipe_json: str,
        run_dir: str,
        attempt: int,
        model_dir: str,
        worker_threads: int = 1,
        started_at: float | None = None,
    ):
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
    def run(self) -> RunOutcome:
        r = self.recipe
        self.plan = plan_placement(r.parallel)
        from vlmrun.data.splits import split_size

        self.steps = plan_steps(r, split_size(r.data.path, r.data.split))
        self.store = CheckpointStore(self.rd.checkpoints(r), r.checkpoint.keep)
        self.metrics = MetricsLog(self.rd.metrics_file(r))
        self.wandb = WandbSink(
            mode=r.logger.wandb_mode,
            project=r.logger.wandb_project,
            run_dir=self.rd.path,
            name=self.rd.path.name,
            run_id=_wandb_id(self.rd.path),
        )
        self._start_workers()
        self._open_loaders()
        start_step, counters, notes = self._resume()
        first_step_at = None
        step = start_step
        for step in range(start_step + 1, self.steps.max_steps + 1):
            if self._stop.is_set():
                step -= 1
                self._save(step, counters)
                return self._outcome(
                    State.STOPPED, step, f"stop requested ({self.stop_reason}); checkpointed at step {step}", notes
                )
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
            return self._outcome(State.STOPPED, step, f"stop requested ({self.stop_reason})", notes)
        return self._outcome(State.COMPLETED, step, f"finished {self.steps.max_steps} steps", notes)

    def _due(self, step: int, period: int) -> bool:
        return step == self.steps.max_steps or (period > 0 and step % period == 0)

    def _outcome(self, state: State, step: int, reason: str, notes: dict) -> RunOutcome:
        self.wandb.close()
        self.group.shutdown()
        for loader in self.loaders.values():
            loader.close()
        signal = self.stop_reason if state is State.STOPPED and self.stop_reason.startswith("SIG") else None
        return RunOutcome(
            state=state,
            last_step=step,
            reason=reason,
            stop_signal=signal,
            max_steps=self.steps.max_steps,
            checkpoint_save_s=self.save_times,
            worker_nodes=self.worker_nodes,
            ray_alive_nodes=sum(1 for n in ray.nodes() if n["Alive"]),
            **notes,
        )

    # ---- set-up ----------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        """One SftWorker per rank (the worker group places them), joined in one process group."""
        c = self.recipe.cluster
        world = self.plan.layout.world_size
        init = dict(
            world_size=world, recipe_json=self.recipe_json, model_dir=self.model_dir, threads=self.worker_threads
        )
        self.group = WorkerGroup(
            SftWorker,
            self.plan,
            Placement(nodes=c.nodes, gpus_per_rank=1 if c.gpus_per_node else 0),
            init=lambda rank: dict(init, rank=rank),
        )
        self.worker_nodes = self.group.node_addresses()
        addr, port = self.group.rendezvous()
        self.group.all_ranks("setup", addr, port, self.steps.max_steps)

    def _open_loaders(self) -> None:
        self.loaders = {}
        if self.recipe.train.loop == "v2":
            self.group.replica_owners(
                "attach_loader",
                lambda shard: dict(
                    shard=shard, num_shards=self.plan.layout.dp, placement_hash=self.plan.placement_hash
                ),
            )
            return
        from vlmrun.data.loader import open_loader_shard

        for s in self.plan.shards:
            self.loaders[s.shard] = open_loader_shard(
                self.recipe,
                processor_dir=self.model_dir,
                shard=s.shard,
                num_shards=s.num_shards,
                placement_hash=self.plan.placement_hash,
                split=self.recipe.data.split,
            )

    def _resume(self) -> tuple[int, dict, dict]:
        rng.seed_all(self.recipe.train.seed)
        counters = {"consumed_samples": 0, "total_valid_tokens": 0}
        found, skipped = self.store.latest()
        notes = {"skipped_checkpoints": skipped} if skipped else {}
        if found is None:
            return 0, counters, notes
        meta = found.manifest
        if meta["placement_hash"] != self.plan.placement_hash:
            raise InputError(
                "parallel",
                self.plan.describe(),
                f"checkpoint {found.path} was written with layout {meta['layout']} "
                f"(placement {meta['placement_hash']}), this run has {self.plan.describe()} "
                f"(placement {self.plan.placement_hash}); resume with the same layout",
            )
        self.group.all_ranks("load", found)
        for shard, loader in self.loaders.items():
            loader.load_state_dict(found.read("loader", index=shard))
        ctrl = found.read("controller")
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
            for s in self.plan.shards:  # each replica starts as soon as its batch is built
                t1 = time.perf_counter()
                batches = [self.loaders[s.shard].next_batch() for _ in range(n_micro)]
                loader_s = max(loader_s, time.perf_counter() - t1)
                refs += self.group.submit_replica(s.shard, "train_step", step=step, micro_batches=batches)
            results = ray.get(refs)
        else:
            results = self.group.all_ranks("train_step", step, n_micro=n_micro)
            loader_s = max(r["loader_s"] for r in results)
        dt = time.perf_counter() - t0
        head = results[0]
        samples = self.steps.global_batch_size
        counters["consumed_samples"] += samples
        counters["total_valid_tokens"] += head["valid_tokens"]
        return {
            "step": step,
            "attempt": self.attempt,
            "epoch": self.steps.epoch_of(step),
            "loss": head["loss"],
            "grad_norm": head["grad_norm"],
            "lr": head["lr"],
            "valid_tokens": head["valid_tokens"],
            "consumed_samples": counters["consumed_samples"],
            "sample_ids": [i for r in results for i in r["sample_ids"]],
            "step_time_s": round(dt, 4),
            "loader_latency_max_s": round(loader_s, 4),
            "tokens_per_s": round(head["valid_tokens"] / dt, 2),
            "samples_per_s": round(samples / dt, 2),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "time": round(time.time(), 3),
        }

    def _validate(self) -> dict:
        r = self.recipe
        if r.train.val_samples <= 0:
            return {}
        if not hasattr(self, "_val"):
            from vlmrun.data.loader import val_batches

            self._val = val_batches(
                r,
                processor_dir=self.model_dir,
                samples=r.train.val_samples,
                batch_size=max(1, r.train.micro_batch_size),
            )
        loss_b, prompt_b = self._val
        n = self.group.world_size
        parts = self.group.per_rank(
            "validate", lambda rank: dict(loss_batches=loss_b[rank::n], prompt_batches=prompt_b[rank::n])
        )
        nll, tokens, correct, answered = [sum(p[k] for p in parts) for k in range(4)]
        return {
            "val_loss": nll / max(tokens, 1),
            "val_accuracy": correct / max(answered, 1),
            "val_samples": int(answered),
            "val_majority_baseline": majority_share([a for b in prompt_b for a in b.answers]),
        }

    def _save(self, step: int, counters: dict) -> None:
        if step <= 0 or self.store.newest_step() == step:
            return
        t0 = time.perf_counter()
        pending = self.store.begin(step)
        files = [f for part in self.group.all_ranks("save", pending) for f in part]
        files += [pending.write("loader", loader.state_dict(), index=shard) for shard, loader in self.loaders.items()]
        files.append(pending.write("controller", {"rng": rng.rng_state(), "counters": counters}))
        meta = {
            "placement_hash": self.plan.placement_hash,
            "layout": self.plan.describe(),
            "loop": self.recipe.train.loop,
            "attempt": self.attempt,
            "counters": counters,
        }
        path = self.store.finish(pending, files, meta)
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
