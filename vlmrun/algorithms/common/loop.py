"""The step loop every training controller runs: resume, step, validate, log, checkpoint, stop.

A controller is one Ray actor beside the driver (common/driver.py starts the class that
algorithms/controllers.py names for `train.algorithm`). `StepLoop` holds what does not depend on the
algorithm; a subclass supplies the algorithm's part:

1. `_start(found)` starts the workers (`_start_workers`: one `RankWorker` subclass per rank) and
   loaders, plane clients, generation before any step; `found` is the checkpoint it will resume
   from, already checked to belong to this run.
2. `_train_step(step, counters)` runs one optimizer step and returns its metrics row (a `StepRow`:
   loss, grad_norm, lr, valid_tokens, consumed_samples, sample_ids, timings, ...). At validation
   steps the loop adds the pass's keys (validation.py), every rank scoring its share.
3. Checkpoints: every worker's `save(pending)` / `load(found, restart_data=...)` writes and reads its
   rank's parts; this class writes the controller's own (its RNG and counters) and the loader shards
   a driver-fed loop owns (`self.loaders`, shard -> loader). The checkpoint it resumes is the one the
   node chose by a stat of its files; the node hashes them meanwhile, while the workers start, and
   hands its verdict in (`checkpoint_verified`) before anything is loaded: the candidate, an older
   one in place of a damaged candidate, or none.
4. `_close()` releases workers and loaders (a subclass adds what else it holds).
5. Neither this module nor the SFT controller imports torch (the ranks start after the controller, so
   its import would delay every rank): its RNG part is python's (it draws from no other), as JSON; the
   val set goes from rank 0 to the ranks by reference (validation.py).

A stop request (signal -> flag -> `request_stop`, or `train.stop_after` reached) is acted on at the
next step boundary: every rank saves, and the run ends as STOPPED (resumable). Once the driver's
process is gone (SIGKILL, node loss), the controller writes no metrics row and no checkpoint more.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time

from vlmrun.algorithms.common.shards import open_train_shard
from vlmrun.algorithms.common.steps import plan_steps, run_loader_format
from vlmrun.algorithms.common.validation import ValidationPasses
from vlmrun.checkpoint.manifest import RunAtSave
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.checkpoint.saving import Saves
from vlmrun.checkpoint.store import run_checkpoints
from vlmrun.checkpoint.write import PendingCheckpoint
from vlmrun.config.identity import RESHARD_TERMS, restarts_data_order, run_identity
from vlmrun.distributed.topology import plan_placement, rng_source
from vlmrun.distributed.worker_group import Placement, WorkerGroup
from vlmrun.errors import CheckFailed
from vlmrun.models.fingerprint import model_contents
from vlmrun.observe.wandb_sink import WandbSink, wandb_id
from vlmrun.policy import rng
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import Holder
from vlmrun.run.metrics import MetricsLog
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.rows import StepRow, Validation
from vlmrun.run.state import State
from vlmrun.startup import freeze_heap

log = logging.getLogger(__name__)


class DriverLost(CheckFailed):
    """The node process that runs this attempt is gone: the controller stops before its next write."""


class StepLoop:
    """See the module docstring. Subclasses set `self.group` (a WorkerGroup) in `_start`."""

    group: WorkerGroup

    def __init__(
        self,
        *,
        recipe_json: str,
        run_dir: str,
        attempt: int,
        model_dir: str,
        worker_threads: int = 1,
        started_at: float | None = None,
        driver: Holder | None = None,
        chosen: tuple[Checkpoint | None, list[str]] | None = None,
        plane_endpoint=None,
        awaits_verdict: bool = False,
    ):
        from vlmrun.config.recipe import Recipe

        self.recipe = Recipe.model_validate_json(recipe_json)
        self.recipe_json, self.model_dir, self.attempt = recipe_json, model_dir, attempt
        self.rd = RunDirectory(run_dir)
        self.worker_threads = worker_threads
        self._stop = threading.Event()
        self.stop_reason = ""
        self._resuming = False  # a checkpoint is loaded after the workers' setup
        self.started_at = started_at or time.time()
        self.driver = driver  # the node process that runs this attempt; none of our writes outlive it
        self.worker_nodes: list[str] = []
        self.policy_layout: str | None = None
        self.policy_load: str | None = None
        self.chosen = chosen  # (checkpoint, skipped) the node chose; None: pick here (store.latest)
        # the node is still hashing `chosen` (`checkpoint_verified` brings its verdict): load nothing before
        self._verdict = threading.Event() if awaits_verdict else None
        self._verdict_value: tuple | None = None
        self.loaders: dict = {}  # shard -> loader, for a loop whose driver builds the batches
        self.plane_endpoint = plane_endpoint  # the job's data-plane servers (TransferQueue); None: local

    def checkpoint_verified(self, found: Checkpoint | None, skipped: list[str], error: BaseException | None) -> None:
        """The node's verdict on the checkpoint it chose (module doc): the one to load, possibly an
        older one, or none; `error` what checking it raised."""
        self._verdict_value = (found, skipped, error)
        self._verdict.set()

    def request_stop(self, reason: str = "signal") -> None:
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    # ---- the algorithm's part --------------------------------------------------------------------
    def _start(self, found: Checkpoint | None) -> None:
        raise NotImplementedError

    def _train_step(self, step: int, counters: dict) -> StepRow:
        raise NotImplementedError

    def _start_workers(self, worker_cls: type, *, optimizer_steps: int, **init) -> None:
        """One `worker_cls` (a RankWorker) per rank, placed by the worker group, joined in one process
        group and set up for `optimizer_steps` (the LR schedule's length); `init` goes to every rank."""
        c = self.recipe.cluster
        owners = {s.owner_rank for s in self.plan.shards}
        replica_of = {rank: s.shard for s in self.plan.shards for rank in s.delivery_ranks}
        init |= dict(
            world_size=self.plan.layout.world_size,
            recipe_json=self.recipe_json,
            model_dir=self.model_dir,
            threads=self.worker_threads,
        )
        self.group = WorkerGroup(
            worker_cls,
            self.plan,
            Placement(nodes=c.nodes, gpus_per_rank=1 if c.gpus_per_node else 0),
            init=lambda rank: dict(init, rank=rank, replica=replica_of[rank], owner=rank in owners),
        )
        self.worker_nodes = self.group.node_addresses()
        addr, port = self.group.rendezvous()
        weights = "checkpoint" if self._resuming else "load"  # a resume's checkpoint fills every weight
        info = self.group.all_ranks("setup", addr, port, optimizer_steps, weights)[0]
        self.policy_layout = info.get("layout")  # job.json's attempt records both
        self.policy_load = info.get("load")

    def _attach_loaders(self) -> None:
        """Each replica's owner rank opens its loader shard (loops whose ranks read their own data)."""
        self.group.replica_owners(
            "attach_loader",
            lambda shard: dict(
                shard=shard,
                num_shards=self.plan.layout.dp,
                placement_hash=self.plan.loader_hash,
                loader_format=self.loader_format,
            ),
        )

    def _save_parts(self, pending: PendingCheckpoint, background: bool = False) -> dict[str, dict]:
        """Every rank's parts (the workers' `save`) and the loader shards this process owns; with
        `background` the policy's files come later (vlmrun/checkpoint/saving.py)."""
        written = self.group.all_ranks("save", pending, background)
        files = {f: d for w in written for f, d in w.items()}
        for shard, loader in self.loaders.items():
            files |= pending.write("loader", loader.state_dict(), index=shard)
        return files

    def _load_parts(self, found: Checkpoint, *, restart_data: bool) -> None:
        """Every rank's parts (at another tp x pp, each rank its replica owner's RNG: `rng_source`), and
        the owned loader shards unless the data order restarts."""
        source = rng_source(self.plan.layout, found.manifest.identity)
        if source is None:
            self.group.all_ranks("load", found, restart_data=restart_data)
        else:
            self.group.per_rank(
                "load", lambda rank: dict(checkpoint=found, restart_data=restart_data, rng_rank=source(rank))
            )
        if not restart_data:
            for shard, loader in self.loaders.items():
                loader.load_state_dict(found.read("loader", index=shard))

    def _close(self) -> None:
        """Release the workers and the loader shards this process owns."""
        self.group.shutdown()
        for loader in self.loaders.values():
            loader.close()

    def _open_loader_shards(self) -> dict:
        """One loader shard per data-parallel replica, opened in this process (loops whose driver
        builds the batches): shard index -> loader."""
        return {
            s.shard: open_train_shard(
                self.recipe,
                self.model_dir,
                shard=s.shard,
                num_shards=s.num_shards,
                placement_hash=self.plan.loader_hash,
                loader_format=self.loader_format,
            )
            for s in self.plan.shards
        }

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        r = self.recipe
        self.plan = plan_placement(r.parallel.layout)
        self.metrics = MetricsLog(self.rd.metrics_file(r))
        self.wandb = WandbSink(
            mode=r.logger.wandb_mode,
            project=r.logger.wandb_project,
            run_dir=self.rd.path,
            name=self.rd.path.name,
            run_id=wandb_id(self.rd.path),
        )
        found, skipped = self._open_checkpoints()
        from vlmrun.data.splits import split_size

        self.loader_format = run_loader_format(found, restart=r.checkpoint.restart_data_order)
        self.steps = plan_steps(r, split_size(r.data.path, r.data.split), loader_format=self.loader_format)
        try:
            return self._run(found, skipped)
        finally:
            self.saves.close()

    def _run(self, found: Checkpoint | None, skipped: list[str]) -> RunOutcome:
        r = self.recipe
        self.restart_data = False
        if found is not None:  # before any worker starts: a refused resume costs nothing
            self.restart_data = self._restarts_data_order(found)
        self._resuming = found is not None
        self._start(found)
        found, skipped = self._take_verdict(found, skipped)
        start_step, counters, notes = self._resume(found, skipped)
        freeze_heap()  # set-up is done: no full collection walks it again, here or in a rank
        self.group.all_ranks("freeze_heap")
        first_step_at = None
        step = start_step
        until = r.train.stop_after
        for step in range(start_step + 1, self.steps.max_steps + 1):
            if until is not None and step > until:
                self.request_stop(f"train.stop_after: {until}")
            if self._stop.is_set():
                step -= 1
                self._save(step, counters)
                self.saves.settle(wait=True)
                return self._outcome(State.STOPPED, step, self._stopped_at(step), notes)
            row = self._train_step(step, counters)
            if first_step_at is None:
                first_step_at = time.time()
                notes["first_step_s"] = round(first_step_at - self.started_at, 3)  # job start -> first step done
            if self._due(step, r.train.val_period) and (validation := self._validate(step)) is not None:
                row = row.with_validation(validation)
                notes["final_val"] = dataclasses.asdict(validation)
            self._check_driver()
            self.metrics.append(row)
            self.wandb.log(row.to_json())
            self.saves.settle(wait=False)
            if self._due(step, r.checkpoint.save_period) or self._stop.is_set():
                self._save(step, counters)
        self.saves.settle(wait=True)
        if self._stop.is_set() and step < self.steps.max_steps:
            return self._outcome(State.STOPPED, step, self._stopped_at(step), notes)
        planned, cap = self.steps.max_steps, f" ({self.steps.cap()})" if self.steps.capped else ""
        where = f"of {planned}{cap}" if step <= planned else f"(its checkpoint was past the {planned} steps planned)"
        trained = f"{step - start_step} step(s) in this attempt" + (
            f", resumed at step {start_step}" if start_step else ""
        )
        return self._outcome(State.COMPLETED, step, f"finished at step {step} {where}; {trained}", notes)

    def _check_driver(self) -> None:
        """Before a write: a controller whose node process died must write nothing more (the run dir
        may hold a new attempt by now); the attempt's reaper ends this process soon after."""
        if self.driver is not None and self.driver.alive() is False:
            raise DriverLost(f"the node process ({self.driver.describe()}) is gone; this attempt writes nothing more")

    def _due(self, step: int, period: int) -> bool:
        return step == self.steps.max_steps or (period > 0 and step % period == 0)

    def _outcome(self, state: State, step: int, reason: str, notes: dict) -> RunOutcome:
        self.store.delete_expired()  # those a reader held past their retention, if let go since
        self.wandb.close()
        self._close()
        signal = self.stop_reason if state is State.STOPPED and self.stop_reason.startswith("SIG") else None
        return RunOutcome(
            state=state,
            last_step=step,
            reason=reason,
            stop_signal=signal,
            max_steps=self.steps.max_steps,
            checkpoint_save_s=self.saves.save_times,
            checkpoint_write_s=self.saves.write_times,
            worker_nodes=self.worker_nodes,
            ray_alive_nodes=self._ray_alive_nodes(),
            policy_layout=self.policy_layout,
            policy_load=self.policy_load,
            **notes,
        )

    def _ray_alive_nodes(self) -> int:
        """The nodes of this attempt's Ray that are alive (the outcome records them)."""
        import ray

        return sum(1 for n in ray.nodes() if n["Alive"])

    def _open_checkpoints(self) -> tuple[Checkpoint | None, list[str]]:
        """The run's store, its identity (with a fingerprint of the model directory, taken before any
        worker loads it) and the checkpoint to resume from: the one the node verified, counted as
        valid here without re-reading it."""
        self.store = run_checkpoints(self.rd, self.recipe)
        self.saves = Saves(self.store, self._check_driver)
        self.identity = run_identity(self.recipe, model_contents=model_contents(self.recipe.model))
        found, skipped = self.chosen if self.chosen is not None else self.store.latest(set_aside=True)
        if found is not None and self._verdict is None:
            self.store.mark_verified(found)
        return found, skipped

    def _take_verdict(self, found: Checkpoint | None, skipped: list[str]) -> tuple[Checkpoint | None, list[str]]:
        """The checkpoint to load once the node's verdict is in (the workers started meanwhile, their
        policies allocated for a checkpoint's load when there was a candidate). An older one instead of a
        damaged candidate is checked like the candidate was; none at all: the ranks read the model's
        own weights after all, and the run trains from step 0."""
        if self._verdict is None:
            return found, skipped
        while not self._verdict.wait(timeout=1.0):
            self._check_driver()  # the node that hashes is gone: nothing more to wait for
        verified, skipped, error = self._verdict_value
        if error is not None:
            raise error
        if verified is not None:
            if verified.step != getattr(found, "step", None):
                self.restart_data = self._restarts_data_order(verified)
            self.store.mark_verified(verified)
        elif found is not None:
            self.group.all_ranks("load_model_weights")
            self.restart_data = False
        self._resuming = verified is not None
        return verified, skipped

    def _restarts_data_order(self, found: Checkpoint) -> bool:
        """Whether `found` is another layout's that the run may take with its data order restarted;
        InputError when it is not this run's (config/identity.py)."""
        restart = self.recipe.checkpoint.restart_data_order
        return restarts_data_order(found.manifest.run, self.identity, self.plan, restart, found.path)

    def _resume(self, found: Checkpoint | None, skipped: list[str]) -> tuple[int, dict, dict]:
        random.seed(self.recipe.train.seed)
        counters = {"consumed_samples": 0, "total_valid_tokens": 0}
        notes = {"skipped_checkpoints": skipped} if skipped else {}
        if found is None:
            return 0, counters, notes
        self._load_parts(found, restart_data=self.restart_data)
        ctrl = found.read("controller")
        if not self.restart_data:  # a format 3 checkpoint's part has numpy's and torch's too, never drawn from here
            rng.set_python_rng_state(ctrl["rng"]["python"])
        counters = dict(ctrl["counters"])
        notes["resumed_from"] = found.step
        if self.restart_data:
            notes["restarted_data_order"] = f"from {found.manifest.run.layout}: {RESHARD_TERMS}"
        elif found.manifest.loader_format != self.loader_format:  # --restart-data-order at the same layout
            notes["restarted_data_order"] = (
                f"from loader format {found.manifest.loader_format} to {self.loader_format}: the loader shards "
                "start their data order over; the model, optimizer state, counters and RNG streams carry on"
            )
        log.info("resumed from %s", found.path)
        return found.step, counters, notes

    def _validate(self, step: int) -> Validation | None:
        """A validation pass of `train.val_samples` val samples (validation.py), every rank scoring its
        share; None when the recipe validates nothing."""
        if self.recipe.train.val_samples <= 0:
            return None
        if not hasattr(self, "_passes"):
            self._passes = ValidationPasses(self.group, self.plan, self.recipe)
        return self._passes.run(step)

    def _stopped_at(self, step: int) -> str:
        """The reason of a stop at the boundary after `step`: the checkpoint it holds (saved, or verified
        when the attempt resumed from it), or that nothing was trained yet."""
        if self.store.holds(step):
            return f"stop requested ({self.stop_reason}); checkpointed at step {step}"
        return f"stop requested ({self.stop_reason}) before the first step; nothing trained, no checkpoint"

    def _save(self, step: int, counters: dict) -> None:
        """The checkpoint of `step`: every part written here (with `checkpoint.async_save` the policy's
        from a copy, on the ranks' threads), sealed behind the next steps (vlmrun/checkpoint/saving.py). One is in flight
        at a time."""
        self.saves.settle(wait=True)
        if step <= 0 or self.store.holds(step):  # already saved, valid: the one resumed from, or just sealed
            return
        t0 = time.perf_counter()
        background = self.recipe.checkpoint.async_save
        pending = self.store.begin(step)
        with self.saves.writing(pending):  # a failed write leaves no partial checkpoint
            files = self._save_parts(pending, background)
            files |= pending.write("controller", {"rng": {"python": rng.python_rng_state()}, "counters": counters})
        run = RunAtSave(
            placement_hash=self.plan.placement_hash,
            layout=self.plan.describe(),
            loop=self.recipe.train.loop,
            algorithm=self.recipe.train.algorithm,
            identity=self.identity,
            attempt=self.attempt,
            counters=counters,
            loader_format=self.loader_format,
        )
        rank_files = (lambda wait: self.group.all_ranks("save_done", wait)) if background else None
        self.saves.begun(pending, files, run, t0, rank_files)
