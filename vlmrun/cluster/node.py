"""The node entrypoint: what every node of a job runs (`python -m vlmrun.cluster.node --run-dir DIR`).

On the embedded default there is one node: it records the attempt in job.json, makes sure data and
model exist, starts a private Ray, runs the driver, records the outcome and exits with
0 (completed), 3 (stopped at a checkpoint, resumable), 1 (failed) or 2 (bad input).

In this order, because each step protects the ones after it:
1. Stop signals (SIGTERM, SIGUSR2, SIGINT) only set the stop flag from the first instant (stop.py);
   a stop before the first step ends the attempt STOPPED without training.
2. Node 0 holds the run lock (run/lock.py) for its life: inherited from the local launcher, or taken
   here on SLURM; a run dir another attempt holds is refused with exit 2 before anything is written.
3. The attempt's reaper starts (reaper.py), then the attempt's marker and temp root go into the
   environment of everything started later: whatever ends this process, its processes end with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from vlmrun.algorithms.common.stop import StopFlag
from vlmrun.cluster.console_tee import ConsoleTee
from vlmrun.cluster.failure import failure_reason
from vlmrun.cluster.reaper import AttemptScope
from vlmrun.cluster.slurm_env import SlurmAllocation
from vlmrun.cluster.third_party_logs import LibrariesBelowError, OursAndErrors, route_ray_logs
from vlmrun.errors import EXIT_BAD_INPUT, VlmrunError
from vlmrun.run import job as job_record
from vlmrun.run.directory import RunDirectory
from vlmrun.run.lock import Holder, RunLock, RunLocked
from vlmrun.run.outcome import RunOutcome
from vlmrun.run.process import local_job_id, start_time
from vlmrun.run.requests import CANCEL_REQUEST, take_request
from vlmrun.run.state import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, State
from vlmrun.startup import pause_for_command

RAY_DEADLINE_S = 180.0  # every node must have joined Ray by then
RECORDED_FD_ENV = "VLMRUN_RECORDED_FD"  # a local launcher closes this pipe once job.json names the job

log = logging.getLogger("vlmrun")
_HELD: list[RunLock] = []
_TEE: list[ConsoleTee] = []  # the attempt log's copy of the console, while the console is attached


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    stop = StopFlag().watch()  # first: before any thread or child process exists
    pause_for_command()  # the collector off while the node imports and sets up (vlmrun/startup.py)
    args = _parse(argv)
    rd = RunDirectory(args.run_dir)
    _setup_logging()
    alloc = SlurmAllocation.from_env()
    job_id = alloc.job_id if alloc else local_job_id(os.getpid(), start_time(os.getpid()))
    node0 = alloc is None or alloc.node_rank == 0
    if node0:
        try:
            _hold_run_lock(rd, job_id)
        except RunLocked as e:
            log.error("%s", e)
            if alloc is not None:
                _tell_workers_done(rd, alloc)
            return e.exit_code
    tee = _tee_log(rd, os.environ.get("VLMRUN_TEE_LOG")) if node0 else None
    try:
        if node0:
            _wait_until_recorded()
        scope = AttemptScope.open()
        console = {"console": tee.console, "log": tee.path} if tee is not None else {}
        scope.start_reaper(run_dir=rd.path if node0 else None, job_id=job_id, **console)
        scope.enter()
        try:
            if not node0:
                return _serve_ray_worker(rd, alloc)  # nodes 1..N-1 join Ray and wait; only node 0 writes job.json
            return _attempt(rd, job_id, alloc, stop, started_at)
        finally:
            scope.sweep()  # a normal end leaves nothing behind either
    finally:
        if tee is not None:
            _TEE.clear()
            tee.close()  # after the sweep: nothing of the attempt writes into its pipes any more


def _attempt(rd: RunDirectory, job_id: str, alloc, stop: StopFlag, started_at: float) -> int:
    restart = alloc.restart_count if alloc else 0
    attempt = job_record.begin_attempt(rd, job_id, restart)
    try:
        outcome = _run(rd, attempt, job_id, started_at, alloc, stop)
    except VlmrunError as e:
        log.error("%s", e)
        _record_failure(rd, attempt, str(e))
        return e.exit_code
    except BaseException as e:  # noqa: BLE001 - our bug or a crash below us: record it, keep the traceback
        reason = failure_reason(e)
        _record_failure(rd, attempt, reason)
        _report_failure(reason)
        return EXIT_FAILED
    job_record.end_attempt(rd, attempt, outcome)
    if alloc is None and take_request(rd, CANCEL_REQUEST, job_id, restart) and outcome.state is State.STOPPED:
        # on SLURM, node 0's requeue decision does this (slurm_entry.py)
        job_record.set_run_state(
            rd, State.CANCELLED, f"cancelled by `vlmrun cancel`; checkpointed at step {outcome.last_step}"
        )
    log.info("%s: %s", outcome.state, outcome.reason)
    val = outcome.final_val
    if val and val.get("val_samples"):
        from vlmrun.observe.progress import val_scored

        loss = "no token scored" if val.get("val_loss") is None else f"val loss {val['val_loss']:.4f}"
        log.info(
            "validation at step %d: accuracy %.3f vs majority-class baseline %.3f on %s (%s)",
            outcome.last_step,
            val["val_accuracy"],
            val["val_majority_baseline"],
            val_scored(val),
            loss,
        )
    return EXIT_STOPPED if outcome.state is State.STOPPED else EXIT_COMPLETED


def _record_failure(rd: RunDirectory, attempt: int, reason: str) -> None:
    """The attempt FAILED with `reason` in job.json; a job.json that cannot be written (a full disk)
    is said on the console, and the failure's own line still follows."""
    try:
        job_record.fail_attempt(rd, attempt, reason)
    except OSError as e:
        log.error("could not record the failure in %s: %s", rd.job_file, failure_reason(e))


def _report_failure(reason: str) -> None:
    """One line on the console with where the traceback is; the traceback itself goes to the log file
    (only the attempt's log when the console is attached, else stderr, which is then the log)."""
    logged = False
    if _TEE:
        try:
            _TEE[0].log_only(traceback.format_exc())
            logged = True
        except OSError:  # a full disk: the traceback goes to the console instead
            pass
    if logged:
        log.error("FAILED: %s (traceback in %s)", reason, _TEE[0].path)
    else:
        traceback.print_exc()
        log.error("FAILED: %s", reason)


def _hold_run_lock(rd: RunDirectory, job_id: str) -> None:
    """Hold the run lock for this process's life: handed over by the local launcher, or taken now (SLURM)."""
    lock = RunLock.inherited(rd.path) or RunLock.acquire(rd.path)
    lock.describe(Holder.of(os.getpid(), job_id))
    _HELD.append(lock)  # never released: the kernel frees it when this process ends


def _wait_until_recorded() -> None:
    """A local launcher records the job in job.json after it started us: begin the attempt only after that."""
    raw = os.environ.pop(RECORDED_FD_ENV, None)
    if raw is None:
        return
    fd = int(raw)
    try:
        while os.read(fd, 64):  # EOF once the launcher closed its end (or died)
            pass
    finally:
        os.close(fd)


def _tell_workers_done(rd: RunDirectory, alloc) -> None:
    """The other nodes of a refused job wait for a Ray head that never comes: let them end now."""
    from vlmrun.run.directory import write_atomic

    write_atomic(alloc.rendezvous(rd.path / "ray") / "done", '{"outcome": "refused"}\n')


def _serve_ray_worker(rd: RunDirectory, alloc) -> int:
    from vlmrun.cluster.ray.allocation import serve_worker
    from vlmrun.cluster.ray.local import set_local_environment

    set_local_environment()
    try:
        return serve_worker(alloc, rd.path / "ray", deadline_s=RAY_DEADLINE_S)
    except VlmrunError as e:
        log.error("%s", e)
        return e.exit_code


def _ray(job_id: str, cpus: int, alloc, rd: RunDirectory):
    """Ray for this attempt: a private local instance, or Ray across the SLURM allocation (node 0)."""
    import contextlib

    if alloc is not None:
        from vlmrun.cluster.ray.allocation import ray_head

        return ray_head(alloc, rd.path / "ray", deadline_s=RAY_DEADLINE_S)

    @contextlib.contextmanager
    def local():

        from vlmrun.cluster.ray.local import start_local_ray, stop_local_ray

        start_local_ray(job_id, cpus)
        try:
            yield
        finally:
            stop_local_ray()

    return local()


def _run(rd: RunDirectory, attempt: int, job_id: str, started_at: float, alloc, stop: StopFlag) -> RunOutcome:
    recipe = rd.load_recipe()
    log.info("attempt %d of %s (%s, loop %s, dp=%d)", attempt, rd.path, job_id, recipe.train.loop, recipe.parallel.dp)
    if stop.is_set():
        return _stopped_before_training(rd, recipe, stop)
    from vlmrun.cluster.ray.local import set_local_environment

    set_local_environment()
    from vlmrun.cluster.preflight import preflight_run
    from vlmrun.datasets.prepare import ensure_dataset
    from vlmrun.models.source import ensure_model
    from vlmrun.observe.progress import ProgressLine

    preflight_run(recipe, runs_here=True)  # again at job start: before data is generated or Ray starts
    ensure_dataset(recipe.data)
    model_dir = ensure_model(recipe.model, rd.cache, recipe.train.seed)
    from vlmrun.data.components import check_components

    check_components(recipe)
    chosen, verdict = _choose_checkpoint(rd, recipe, attempt)
    if stop.is_set():
        return _stopped_before_training(rd, recipe, stop, _verified(chosen, verdict))
    cpus = max(recipe.parallel.world_size, os.cpu_count() or 1)
    route_ray_logs()  # before Ray starts: its start-up and the workers' lines are levelled down too
    with _ray(job_id, cpus, alloc, rd):
        if stop.is_set():
            return _stopped_before_training(rd, recipe, stop, _verified(chosen, verdict))
        from vlmrun.algorithms.common.steps import plan_steps, run_loader_format
        from vlmrun.data.splits import split_size

        # The same step count the controller uses (train.max_steps capped by epochs), so the ETA is right.
        loader_format = run_loader_format(chosen[0], restart=recipe.checkpoint.restart_data_order)
        plan = plan_steps(recipe, split_size(recipe.data.path, recipe.data.split), loader_format=loader_format)
        progress = ProgressLine(plan.max_steps, cap=plan.cap())
        run = dict(attempt=attempt, model_dir=model_dir, stop=stop, started_at=started_at, chosen=chosen)
        run["verdict"] = verdict
        run["on_row"] = lambda row: log.info("%s", progress(row))
        return _run_controller(rd, recipe, job_id, run)


def _run_controller(rd: RunDirectory, recipe, job_id: str, run: dict) -> RunOutcome:
    """The controller of `train.algorithm` between the job's data-plane servers (none for `local` or a
    disabled plane: every SFT run), on node 0. A server that dies ends the attempt within seconds,
    FAILED with one line naming it (plane_servers.py)."""
    import ray

    from vlmrun.algorithms.common.driver import run_controller
    from vlmrun.algorithms.controllers import controller_host
    from vlmrun.cluster.plane_servers import running_plane_servers, watched
    from vlmrun.cluster.ray.nodes import port_block

    controller = controller_host(recipe.train.algorithm)  # the controller's module is imported in its actor
    dp = recipe.data_plane
    impl = dp.impl if dp.enabled else "local"
    host = ray.util.get_node_ip_address()
    with (
        running_plane_servers(impl, dp.backend, block=port_block(job_id), host=host, log_dir=rd.logs) as servers,
        watched(servers, on_hard_exit=lambda reason: job_record.fail_attempt(rd, run["attempt"], reason)),
    ):
        return run_controller(controller, rd, recipe, plane_endpoint=servers.endpoint, **run)


def _choose_checkpoint(rd: RunDirectory, recipe, attempt: int):
    """The checkpoint this attempt starts from: the newest of this run whose files are all there at
    their sizes (a stat each; newer ones that are not, moved aside), and a Future of the verdict on it
    (`CheckpointStore.verify_candidate` on a thread: every file hashed while Ray and the workers start;
    damaged, the newest older one that verifies instead). The controller waits for the verdict before
    it loads anything. Claims the checkpoint folder for the run first: one that belongs to another run,
    or to the run a copied run dir was copied from, is refused (InputError, exit 2) before anything is
    read; a copy with checkpoints of its own goes on as a fork (vlmrun/checkpoint/copies.py). When no valid checkpoint is left, say so
    plainly, on the console and in job.json, before training starts from step 0."""
    from concurrent.futures import Future

    from vlmrun.checkpoint.copies import settle_copy
    from vlmrun.checkpoint.store import run_checkpoints

    if (fork := settle_copy(rd, recipe)) is not None:  # a copied run dir goes on as a run of its own
        log.info("%s is a copy of %s: it goes on as a fork, run id %s", rd.path, fork.from_run_dir, fork.run_id)
        job_record.record_fork(rd, attempt, fork.run_id, fork.from_run_id, fork.from_run_dir)
    store = run_checkpoints(rd, recipe)
    store.claim()
    candidate, skipped = store.latest(set_aside=True, checksums=False)
    verdict: Future = Future()

    def check() -> None:
        try:
            found, more = store.verify_candidate(candidate) if candidate is not None else (None, [])
            if found is None and (skipped or more):
                notice = f"no valid checkpoint left ({'; '.join(skipped + more)}): training from step 0"
                log.warning("%s", notice)
                job_record.note_attempt(rd, attempt, notice)
            verdict.set_result((found, skipped + more))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the verdict
            verdict.set_exception(e)

    if candidate is None:  # nothing to hash: no verdict to wait for
        check()
        return verdict.result(), None
    threading.Thread(target=check, name="checkpoint-verify", daemon=True).start()
    return (candidate, skipped), verdict


def _verified(chosen, verdict):
    """What the node knows to be valid now: `chosen` when there is no verdict to wait for, the verdict
    once it is in (the stop's message may then name the checkpoint), else None."""
    if verdict is None:
        return chosen
    return verdict.result() if verdict.done() and verdict.exception() is None else None


def _stopped_before_training(rd: RunDirectory, recipe, stop: StopFlag, chosen=None) -> RunOutcome:
    """A stop that came before the first step: nothing trained. The reason names the checkpoint the
    run stays at only once it has been verified (`chosen`); before that, verifying it would cost a
    full read in the stop's grace time, so the next attempt does."""
    from vlmrun.checkpoint.store import run_checkpoints

    name = stop.signal_name or "requested"
    reason = f"stop requested ({name}) before training started; nothing trained in this attempt"
    if chosen is None:
        sealed = run_checkpoints(rd, recipe).complete()
        step = sealed[-1][0] if sealed else 0
    else:
        found = chosen[0]
        step = found.step if found is not None else 0
        reason += (
            f"; the run stays at its checkpoint of step {step}" if found else "; no valid checkpoint to resume from"
        )
    return RunOutcome(
        state=State.STOPPED,
        last_step=step,
        reason=reason,
        stop_signal=name if name.startswith("SIG") else None,
    )


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m vlmrun.cluster.node", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    return p.parse_args(argv)


def _setup_logging() -> None:
    """The console: our records and everyone's errors; the libraries' chatter is levelled down
    (third_party_logs.py) into the attempt's third-party log, once this process holds the run."""
    logging.captureWarnings(True)
    _add_handler(logging.StreamHandler(sys.stderr), OursAndErrors())
    logging.getLogger().setLevel(logging.INFO)


def _tee_log(rd: RunDirectory, path: str | None) -> ConsoleTee | None:
    """With the console attached (`path`: the attempt's log), copy everything this process and the ones
    it starts write to the console into that file too (console_tee.py; only once this process holds the
    run); either way, the libraries' records below ERROR go to the attempt's third-party log."""
    third_party = rd.attempt_log(job_record.next_attempt(rd)).with_suffix(".third-party.log")
    third_party.parent.mkdir(exist_ok=True)
    _add_handler(logging.FileHandler(third_party, delay=True), LibrariesBelowError())
    if not path:
        return None
    _TEE.append(ConsoleTee(Path(path)))
    return _TEE[0]


def _add_handler(handler: logging.Handler, only: logging.Filter) -> None:
    handler.setFormatter(_FORMAT)
    handler.addFilter(only)
    logging.getLogger().addHandler(handler)


_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if code is not None else EXIT_BAD_INPUT)
