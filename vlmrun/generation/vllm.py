"""The `vllm` generation backend: the rank's handle on a vLLM engine that runs in a process of its own.

1. The engine (vllm_engine.py) is a Ray actor started with the interpreter of the engine's environment
   (vllm_env.py: vLLM's line and the torch it pins; the policy keeps the project's torch), on this
   rank's node and, on a GPU, this rank's GPU (its CUDA_VISIBLE_DEVICES; no Ray resources of its own:
   the policy and the engine share the rank's device and never run at once). Its vlmrun is the rank's
   own (`engine_module_path`). The trainer's process is left as it was: no process group of vLLM's over
   the training world, no global RNG reset, no garbage-collector freeze, no torch threads changed.
2. Prompts are ours (`engine_prompts`): the token ids the policy scores, left padding dropped, and each
   prompt's pixel rows with their grid, which the engine encodes with its own vision tower and hands
   to vLLM as embeddings; each image's run of placeholder tokens is collapsed to one, which vLLM
   expands again to as many tokens as the embeddings have. A prompt's images are sent and encoded once
   for its n responses.
3. Sampling is seeded per response (`response_seed`: the run's seed, this replica's call count, the
   prompt's sample id and the response's index), so the responses do not depend on batching or on
   which engine step a request lands in; `state_dict` keeps the call count, so a resumed run draws the
   responses an uninterrupted one draws. Greedy calls (validation) draw nothing and count nothing.
   Placeholder and suppressed tokens are never drawn (a -100 logit bias, which the raw log-probs do not
   see); a response stops at the model's end-of-turn tokens; each sampled token's log-prob is vLLM's
   raw one (the logits before any processing), what a teacher-forced forward of the same weights gives.
4. `load_weights` copies each bucket the policy draws into one shared segment (vllm_wire.py: /dev/shm on
   a host, one CUDA buffer with an IPC handle on a GPU) that the engine loads from before the next is
   drawn: every weight exactly once, one bucket beyond the engine's weights, nothing through the host
   on a GPU.
5. Memory between uses. On a GPU the engine sleeps (`release_weights`: weights and KV cache freed, both
   multimodal caches reset); before each wake this process's cached blocks go back to the device
   (`return_cached_blocks`: the training peak, and what `parallel.offload_during_generation` moved to
   the host, stay in PyTorch's cache otherwise, where vLLM cannot map them). The weights wake for the
   refit, the KV cache at the next `generate` (after the offload moved the policy's weights away).
   Where the platform has no sleep mode (vLLM's CPU backend), `release_weights` ends the engine's
   process when the recipe asks for it (`generation.release_weights`), and the next refit starts a
   new one; otherwise the engine keeps its memory. Either way `generate` is refused until a refit.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vlmrun.data.batch import PromptBatch
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.generation.prompts import select_prompts
from vlmrun.generation.rollouts import Rollouts
from vlmrun.generation.special_tokens import SpecialTokens
from vlmrun.generation.vllm_env import engine_environment
from vlmrun.generation.vllm_requests import engine_prompts, response_seed, rollouts_from, sampling_options
from vlmrun.generation.vllm_wire import segment_for
from vlmrun.models.spec import ModelSpec

log = logging.getLogger(__name__)

#: The KV cache of an engine on a CPU unless generation.vllm.kv_cache_memory_bytes says otherwise: vLLM
#: would take gpu_memory_utilization of the host's memory, which every rank and engine shares.
CPU_KV_CACHE_BYTES = 1 << 30
#: How long a started engine may take to come up (its interpreter's imports and vLLM's start-up).
START_TIMEOUT_S = 600.0


def return_cached_blocks() -> None:
    """This process's unreferenced objects collected and PyTorch's cached device blocks given back to
    the device (module doc); nothing without CUDA."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def engine_module_path() -> str:
    """A folder holding only a link to this process's vlmrun package: the engine's PYTHONPATH, so it runs
    the rank's own code and nothing else of the rank's environment (its torch above all)."""
    package = Path(__file__).resolve().parents[1]
    key = hashlib.blake2b(str(package).encode(), digest_size=6).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"vlmrun-engine-path-{os.getuid()}" / key
    link = folder / "vlmrun"
    if not (link.is_symlink() and link.resolve() == package):
        folder.mkdir(parents=True, exist_ok=True)
        fresh = folder / f".vlmrun-{os.getpid()}"
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(package, target_is_directory=True)
        fresh.replace(link)  # atomic: ranks starting at once all see a whole link
    return str(folder)


class VllmGenerator(GenerationBackend):
    """Replica `replica`'s vLLM engine of `model`, in the spec's dtype, for a rank on `device` ("cuda":
    this rank's GPU; "cpu": vLLM's CPU backend). `options` come from `GenerationConfig.engine_options`:
    {"engine": vLLM's engine arguments, "env": the engine environment (None: vllm_env.py's default),
    "end_on_release": bool (module doc)}. Built by `vlmrun.generation.open_generator`; Ray must be
    running in this process."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        replica: int = 0,
        device: str = "cuda",
        threads: int | None = None,
        weights_from_refit: bool = False,
        options: Mapping[str, Any] | None = None,
    ):
        if model.directory is None:
            raise ValueError("the vllm backend opens a model directory (random init happens in the policy)")
        options = dict(options or {})
        self.spec, self.replica, self.threads = model, replica, threads
        self.on_gpu = str(device).startswith("cuda")
        self.engine_args = dict(options.get("engine") or {})
        if not self.on_gpu:  # generation.vllm's CPU defaults (config/generation.py)
            self.engine_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
            self.engine_args.setdefault("enforce_eager", True)
        self.env_setting = options.get("env")
        self.end_on_release = bool(options.get("end_on_release", False))
        self.weights_from_refit = weights_from_refit
        self.weights_dtype = model.dtype
        self._seed: int | None = None
        self._calls = 0
        self._actor: Any = None
        self.info: dict[str, Any] = {}
        self._released = False  # generate refused until the next refit
        self._asleep: set[str] = set()  # what of the engine sleeps ("weights", "kv_cache")

    # ---- the engine's process ----------------------------------------------------------------------
    def _call(self, method: str, *args, timeout: float | None = None) -> Any:
        import ray

        return ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)

    def _start_engine(self) -> None:
        """Start the engine's actor and its engine (module doc)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from vlmrun.generation.vllm_engine import ENGINE_ENV, VllmEngine

        if not ray.is_initialized():
            raise RuntimeError("the vllm backend starts its engine as a Ray actor: start Ray in this process first")
        env = engine_environment(self.env_setting, on_gpu=self.on_gpu)
        return_cached_blocks()  # vLLM takes its share of what the device has free when it starts
        env_vars = {**ENGINE_ENV, "PYTHONPATH": engine_module_path()}
        if self.threads:
            env_vars["OMP_NUM_THREADS"] = str(self.threads)
        devices = os.environ.get("CUDA_VISIBLE_DEVICES") if self.on_gpu else None
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = (
            ray.remote(VllmEngine)
            .options(
                num_cpus=0,
                num_gpus=0,
                scheduling_strategy=here,
                runtime_env={"py_executable": str(env.python), "env_vars": env_vars},
            )
            .remote(
                model_dir=self.spec.directory,
                dtype=self.spec.dtype,
                options=self.engine_args,
                weights_from_refit=self.weights_from_refit,
                threads=self.threads,
                devices=devices,
            )
        )
        self.info = self._call("start", timeout=START_TIMEOUT_S)
        self._asleep = set()

    def _end_engine(self) -> None:
        """Stop the engine and end its process (waiting until it is gone)."""
        import ray

        if self._actor is None:
            return
        actor, self._actor = self._actor, None
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except ray.exceptions.RayError as e:  # it died already (what ended it is the caller's error to report)
            log.warning("the vllm engine (pid %s) did not stop cleanly: %s", self.info.get("pid"), type(e).__name__)
        finally:
            ray.kill(actor)
        wait_gone(self.info.get("pid"))

    @property
    def sleep_mode(self) -> bool:
        return bool(self.info.get("gates", {}).get("sleep_mode"))

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            return_cached_blocks()  # module doc
            self._call("wake", [tag])
            self._asleep.discard(tag)

    # ---- the interface -------------------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        self.tokens = SpecialTokens.of_directory(self.spec.directory)
        self.eos_ids, self.pad_token_id = list(self.tokens.eos_ids), self.tokens.pad_token_id
        self._start_engine()
        if self.weights_from_refit:  # filled by the first refit: asleep until then where it can sleep
            self._release(end=False)
        return {"replica": self.replica, "params": self.info["params"], "image_token_id": self.tokens.image_token_id}

    def generate(self, prompts: PromptBatch, sampling: SamplingParams, *, n: int) -> Rollouts:
        if self._released:
            raise RuntimeError("the engine's weights were released (generation.release_weights): refit it first")
        if n < 1 or len(prompts) == 0:
            raise ValueError(f"generate needs at least one prompt and n >= 1, got {len(prompts)} prompts and n={n}")
        t0 = time.perf_counter()
        greedy = sampling.temperature == 0
        if not greedy:
            if sampling.seed != self._seed:
                self._seed, self._calls = sampling.seed, 0
            call, self._calls = self._calls, self._calls + 1
        self._wake("kv_cache")
        draws = [
            (
                i,
                sampling_options(
                    sampling,
                    None if greedy else response_seed(sampling.seed, call, prompts.sample_ids[i], g),
                    self.tokens,
                ),
            )
            for i in range(len(prompts))
            for g in range(n)
        ]
        drawn = self._call("generate", engine_prompts(prompts, self.tokens.image_token_id), draws)
        batch = select_prompts(prompts, [i for i, _ in draws], self.tokens.image_token_id)
        return rollouts_from(drawn, batch, n=n, tokens=self.tokens, generate_s=time.perf_counter() - t0)

    def load_weights(self, weights: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        if self._actor is None:  # ended at the last release (module doc)
            self._start_engine()
        self._wake("weights")
        self._call("begin_refit")
        segment = None
        try:
            for bucket in [weights] if isinstance(weights, Mapping) else weights:
                if not bucket:
                    continue
                segment = segment or segment_for(bucket)
                self._call("load_bucket", segment.put(bucket))
                segment.mapped()
                bucket = None  # before the next is drawn: the policy gathers it with this one freed
            self._call("finish_refit")
        finally:
            if segment is not None:
                segment.close()
        self._released = False

    def release_weights(self) -> None:
        self._release(end=self.end_on_release)

    def _release(self, *, end: bool) -> None:
        """Sleep where the platform can, else end the engine's process when `end` (module doc)."""
        if self._released:
            return
        if self.sleep_mode:
            self._call("sleep")
            self._asleep = {"weights", "kv_cache"}
        elif end:
            self._end_engine()
        self._released = True

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "calls" not in state:
            raise ValueError("this checkpoint's sampling state is another generation backend's (generation.backend)")
        self._seed, self._calls = state["seed"], state["calls"]

    def shutdown(self) -> None:
        self._end_engine()
        return_cached_blocks()


def wait_gone(pid: int | None, timeout: float = 60.0) -> None:
    """Until process `pid` has ended (Ray ends a killed actor's process a moment later)."""
    import psutil

    deadline = time.monotonic() + timeout
    while pid is not None and psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
