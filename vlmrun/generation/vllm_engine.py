"""The vllm engine's own process: vLLM's `LLM` in a Ray actor started from the engine's environment.

The rank's side (vllm.py) starts `VllmEngine` as a Ray actor whose interpreter is the engine
environment's (vLLM's line and the torch it pins; tools/vllm_env/build.sh), on the rank's node and
GPU, and drives it with plain values only: token ids, numpy pixel rows, option dicts, and the
`BucketMessage`s of vllm_wire.py for a refit. This module imports only what that environment has
(the standard library, numpy, torch, vLLM, and vlmrun modules of the same kind) and vLLM only inside
the actor.

1. `start` builds the engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the rank: the
   engine core runs here, so a refit and the vision pass reach its model directly) with
   `logprobs_mode="raw_logprobs"` and, when its weights come from a refit, `load_format="dummy"`.
   What the installed vLLM offers is detected (`EngineGates`), never assumed from its version: sleep
   mode where the platform has it (vLLM's CPU platform refuses it at engine start), vLLM's layerwise
   reload for a refit (the CPU backend repacks linear weights after loading, so a plain
   `load_weights` over them fails), `mm_device_do_normalize=False` where vLLM would normalise pixels
   itself (ours are normalised by the policy's processor already), `reset_mm_cache`.
2. A refit is `begin_refit`, one `load_bucket` per bucket, `finish_refit`: the model's own
   `load_weights` of each bucket's tensors (the policy's names; vLLM maps them onto its fused
   parameters) between vLLM's `initialize_layerwise_reload` and `finalize_layerwise_reload`; every
   tensor comes once and every engine parameter must be filled. Then the prefix, encoder and
   multimodal caches are reset: they hold the old weights' work.
3. `generate` encodes each prompt's images once with the engine's own vision tower (the policy's
   pixel rows, so the engine sees exactly what the policy scores), hands them to vLLM as embeddings
   with their grid, and returns each draw's token ids and raw log-probs as lists.
4. `sleep` (GPU): both multimodal caches reset (the front end's survives a sleep, and the same image
   sent again would hit a cache entry the engine no longer has), then `sleep(level=2)`, then this
   process's own cached blocks go back to the device. `wake` brings back "weights" or "kv_cache".
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from vlmrun.generation.vllm_wire import BucketMessage, EngineSegments

#: The engine's process environment, set by the rank when it starts the actor (read at vLLM's import).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process (module doc)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # vLLM's own sampler: per-request seeds, the same on CPU and GPU
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the rank's thread count, no core binding beside the policy
    "VLLM_LOGGING_LEVEL": "ERROR",  # an engine start is not news in the run's log; its errors are
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class EngineGates:
    """What the installed vLLM offers (module doc)."""

    sleep_mode: bool
    layerwise_reload: bool
    normalizes_pixels: bool  # vLLM would normalise pixels in the model unless told not to
    reset_mm_cache: bool


def detect_gates() -> EngineGates:
    """The gates of the vLLM installed in this process's environment."""
    import importlib.util

    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    reload = importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None
    if reload:
        from vllm.model_executor.model_loader import reload as module

        reload = all(hasattr(module, f) for f in ("initialize_layerwise_reload", "finalize_layerwise_reload"))
    return EngineGates(
        sleep_mode=bool(current_platform.is_sleep_mode_available()),
        layerwise_reload=reload,
        normalizes_pixels="mm_device_do_normalize" in EngineArgs.__dataclass_fields__,
        reset_mm_cache=hasattr(vllm.LLM, "reset_mm_cache"),
    )


class VllmEngine:
    """vLLM's engine of the model in `model_dir`, in `dtype`, with the recipe's `options` (vLLM's own
    engine arguments); `threads` torch threads; `devices` the rank's CUDA_VISIBLE_DEVICES (None on CPU)."""

    def __init__(
        self,
        *,
        model_dir: str,
        dtype: str,
        options: dict[str, Any],
        weights_from_refit: bool,
        threads: int | None = None,
        devices: str | None = None,
    ):
        if devices is not None:  # before torch reads it: the rank's own GPU
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        self.model_dir, self.dtype, self.options = model_dir, dtype, dict(options)
        self.weights_from_refit, self.threads = weights_from_refit, threads
        self.llm: Any = None
        self.segments = EngineSegments()
        self._came: set[str] = set()
        self._filled: set[str] = set()

    def start(self) -> dict[str, Any]:
        """Build the engine (module doc); its parameter count, gates, versions and process id."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)  # before vLLM starts: afterwards a no-op in this process
        import vllm

        self.gates = detect_gates()
        extra: dict[str, Any] = {}
        if self.gates.sleep_mode:
            extra["enable_sleep_mode"] = True
        if self.gates.normalizes_pixels:
            extra["mm_device_do_normalize"] = False
        self.llm = vllm.LLM(
            model=self.model_dir,
            dtype=self.dtype,
            seed=0,  # every sampled request carries its own seed
            tensor_parallel_size=1,
            load_format="dummy" if self.weights_from_refit else "auto",
            enable_mm_embeds=True,
            logprobs_mode="raw_logprobs",
            **extra,
            **self.options,
        )
        (params,) = self.llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
        from vlmrun.startup import resume

        resume()  # the collector, which Ray's worker set-up hook paused for the imports
        return {
            "params": params,
            "gates": asdict(self.gates),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "pid": os.getpid(),
            "prefix": sys.prefix,  # the environment this process runs in
        }

    # ---- refit (module doc) ------------------------------------------------------------------
    def begin_refit(self) -> None:
        self._came, self._filled = set(), set()
        if self.gates.layerwise_reload:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.llm.apply_model(initialize_layerwise_reload)

    def load_bucket(self, message: BucketMessage) -> int:
        """Load one bucket's tensors; how many. KeyError names a tensor that came twice."""
        import torch

        tensors = list(self.segments.tensors(message))
        if twice := sorted(self._came.intersection(name for name, _ in tensors)):
            raise KeyError(f"refit: {twice[0]!r} came twice")
        self._came.update(name for name, _ in tensors)

        @torch.no_grad()
        def load(model) -> set[str]:
            return set(model.load_weights(iter(tensors)))

        (filled,) = self.llm.apply_model(load)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies read the rank's buffer, which it refills once this returns
        self._filled |= filled
        return len(tensors)

    def finish_refit(self) -> int:
        """Finish the reload and reset the caches; the engine parameters filled. KeyError names those
        no tensor filled."""
        self.segments.close()
        if self.gates.layerwise_reload:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            config = self.llm.llm_engine.vllm_config

            def finalize(model) -> None:
                with set_current_vllm_config(config):
                    finalize_layerwise_reload(model, config.model_config)

            self.llm.apply_model(finalize)
        (names,) = self.llm.apply_model(lambda model: {name for name, _ in model.named_parameters()})
        if missing := sorted(names - self._filled):
            raise KeyError(
                f"refit: {len(missing)} engine parameters were filled by no policy tensor, e.g. {missing[:3]}"
            )
        self._reset_caches()
        return len(self._filled)

    def _reset_caches(self) -> None:
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        if self.gates.reset_mm_cache:
            self.llm.reset_mm_cache()

    # ---- generation (module doc) --------------------------------------------------------------
    def generate(self, prompts: list[dict], draws: list[tuple[int, dict]]) -> list[tuple[list[int], list[float]]]:
        """Draw `draws` ((prompt index, vLLM SamplingParams arguments) each) from `prompts` ({"ids",
        and "pixels" with "grid" for a prompt with images}); each draw's token ids and log-probs."""
        from vllm import SamplingParams

        embeds = self._image_embeds(prompts)
        requests = []
        for i, _ in draws:
            request: dict[str, Any] = {"prompt_token_ids": prompts[i]["ids"]}
            if embeds[i] is not None:
                request["multi_modal_data"] = {"image": embeds[i]}
            requests.append(request)
        params = [SamplingParams(**options) for _, options in draws]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = []
        for o in outputs:
            drawn = o.outputs[0]
            ids = list(drawn.token_ids)
            if drawn.logprobs is None or len(drawn.logprobs) != len(ids):
                raise ValueError(f"request {o.request_id}: the engine returned no log-prob for each sampled token")
            out.append((ids, [step[t].logprob for step, t in zip(drawn.logprobs, ids, strict=True)]))
        return out

    def _image_embeds(self, prompts: list[dict]) -> list[dict | None]:
        """Each prompt's images through the engine's vision tower, {image_embeds, image_grid_thw}."""
        import torch

        if not any(p.get("pixels") is not None for p in prompts):
            return [None] * len(prompts)

        @torch.no_grad()
        def encode(model) -> list[dict | None]:
            device, dtype = next(model.parameters()).device, model.visual.dtype
            out: list[dict | None] = []
            for p in prompts:
                if p.get("pixels") is None:
                    out.append(None)
                    continue
                grid = torch.tensor(p["grid"], dtype=torch.long)
                pixels = torch.tensor(p["pixels"], device=device, dtype=dtype)  # Ray hands a read-only array
                parts = model._process_image_input(
                    {"type": "pixel_values", "pixel_values": pixels, "image_grid_thw": grid}
                )
                out.append({"image_embeds": torch.cat(list(parts)), "image_grid_thw": grid})
            return out

        (embeds,) = self.llm.apply_model(encode)
        return embeds

    # ---- memory (module doc) ------------------------------------------------------------------
    def sleep(self) -> None:
        if self.gates.reset_mm_cache:
            self.llm.reset_mm_cache()
        self.llm.sleep(level=2)
        _return_cached_blocks()

    def wake(self, tags: list[str]) -> None:
        _return_cached_blocks()
        self.llm.wake_up(tags=tags)

    def stop(self) -> int:
        """Drop the engine; this process's id (the rank ends the process next)."""
        self.segments.close()
        self.llm = None
        _return_cached_blocks()
        return os.getpid()


def _return_cached_blocks() -> None:
    """What this process's torch keeps cached goes back to the device (nothing on a CPU)."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
