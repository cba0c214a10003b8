"""The `vllm` generation backend: vLLM's engine in the rank's own process, on its GPU, beside the policy.

1. One engine per rank (tensor parallel 1), built in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
   the engine core runs in the caller's process, so a refit and the vision pass below reach its model
   directly, verl's route) with sleep mode on and `logprobs_mode="raw_logprobs"`: the log-prob of each
   sampled token under the raw logits, what a teacher-forced forward of the same weights gives (the
   interface's contract; temperature and top-p shape only the draw). Built with `load_format="dummy"`
   when its weights come from a refit (a training rank reads nothing from disk twice).
2. Prompts are ours (`engine_requests`): the token ids the policy scores, left padding dropped. Images
   are our processor's pixel rows, encoded by the engine's own vision tower in this process
   (`_image_embeds`) and handed to vLLM as embeddings with their grid; each image's run of
   placeholder tokens is collapsed to one, which vLLM's processor expands again to as many tokens as
   the embeddings have. So the engine sees exactly the pixels and ids the policy scores, and a
   prompt's images are encoded once for its n responses (which the prefix cache also shares).
3. Sampling is seeded per response (`response_seed`: the run's seed, this replica's call count, the
   prompt's sample id and the response's index), so the responses do not depend on batching or on
   which engine step a request lands in; `state_dict` keeps the call count, so a resumed run draws
   the responses an uninterrupted one draws. Greedy calls (validation) draw nothing and count nothing.
   The model's placeholder tokens and the suppressed ones are never drawn (a -100 logit bias, which
   the raw log-probs do not see). A response stops at the model's end-of-turn tokens.
4. `load_weights` wakes the engine's weights when they sleep, feeds the policy's buckets to vLLM's
   model class (`vllm_weights.refit_model`: every engine parameter filled, bucket by bucket, on the
   GPU), wakes the KV cache and resets the prefix and encoder caches (they hold the old weights'
   work). `release_weights` is `sleep(level=2)`: weights and KV cache freed until the next refit.

Nothing here runs without a CUDA device and the vllm package; the pure parts (requests, seeds,
results) are tested on CPU (tests/test_vllm_backend.py), the naming of the refit against vLLM's real
classes (tests/test_vllm_classes.py), the engine on a lent GPU (tools/gpu/vllm_check.py).
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from vlmrun.data.batch import PromptBatch
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.generation.prompts import ROWS_KEY, prompt_media, select_prompts
from vlmrun.generation.rollouts import Rollouts, response_mask
from vlmrun.generation.special_tokens import SpecialTokens
from vlmrun.generation.vllm_weights import refit_model
from vlmrun.models.spec import ModelSpec

#: Set for the engine unless the environment says otherwise (module doc, 1; FlashInfer's sampler is
#: not among the carried wheels).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
NEVER_BIAS = -100.0


def collapse_placeholders(ids: Sequence[int], token: int) -> list[int]:
    """`ids` with every run of `token` shortened to one (module doc, 2)."""
    out: list[int] = []
    for t in ids:
        if not (t == token and out and out[-1] == token):
            out.append(int(t))
    return out


def response_seed(seed: int, call: int, sample_id: str, response: int) -> int:
    """A 63-bit seed for response `response` to prompt `sample_id` in sampling call `call` of a run
    seeded `seed` (module doc, 3): distinct inputs give unrelated seeds."""
    key = f"{seed}\0{call}\0{sample_id}\0{response}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def engine_requests(prompts: PromptBatch, image_token_id: int | None, embeds: Sequence[dict | None]) -> list[dict]:
    """One vLLM prompt per row of `prompts`: its ids without the left padding (placeholder runs
    collapsed where it has images) and `embeds[i]`, its images' embeddings with their grid, as
    multimodal data."""
    out = []
    for i in range(len(prompts)):
        ids = prompts.input_ids[i][prompts.attention_mask[i].bool()].tolist()
        request: dict[str, Any] = {"prompt_token_ids": ids}
        if embeds[i] is not None:
            request["prompt_token_ids"] = collapse_placeholders(ids, image_token_id)
            request["multi_modal_data"] = {"image": embeds[i]}
        out.append(request)
    return out


def sampling_options(sampling: SamplingParams, seed: int | None, tokens: SpecialTokens) -> dict[str, Any]:
    """vLLM's SamplingParams for one response (n=1) drawn with `seed` (None: greedy)."""
    return {
        "n": 1,
        "temperature": sampling.temperature if seed is not None else 0.0,
        "top_p": sampling.top_p if seed is not None else 1.0,
        "top_k": 0,  # no top-k: SamplingParams has none
        "max_tokens": sampling.max_new_tokens,
        "seed": seed,
        "logprobs": 0,  # the sampled token's own
        "stop_token_ids": list(tokens.eos_ids),
        "logit_bias": {t: NEVER_BIAS for t in tokens.never_generated} or None,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def rollouts_from(
    outputs: Sequence[Any], batch: PromptBatch, *, n: int, tokens: SpecialTokens, generate_s: float
) -> Rollouts:
    """The `Rollouts` of vLLM's outputs, one per row of `batch` (the prompts each repeated n times),
    in order: response ids right-padded, each sampled token's log-prob (vLLM's `logprobs=0` entry
    for the token it drew), the mask up to the first end-of-turn token."""
    drawn = [o.outputs[0] for o in outputs]
    if len(drawn) != len(batch):
        raise ValueError(f"the engine answered {len(drawn)} requests of {len(batch)}")
    width = max(1, max(len(d.token_ids) for d in drawn))
    ids = torch.full((len(drawn), width), tokens.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(drawn), width, dtype=torch.float32)
    for row, d in enumerate(drawn):
        if d.logprobs is None or len(d.logprobs) != len(d.token_ids):
            raise ValueError(f"request {row}: the engine returned no log-prob for each sampled token")
        for t, token in enumerate(d.token_ids):
            ids[row, t] = token
            logprobs[row, t] = d.logprobs[t][token].logprob
    lengths = torch.tensor([len(d.token_ids) for d in drawn])
    drew = torch.arange(width)[None, :] < lengths[:, None]  # the padding is not a token (its id may be an eos id)
    mask = response_mask(ids, tokens.eos_ids) * drew
    return Rollouts.sampled(
        batch,
        n=n,
        response_ids=ids,
        mask=mask,
        logprobs=logprobs,
        pad_token_id=tokens.pad_token_id,
        generate_s=generate_s,
    )


class VllmGenerator(GenerationBackend):
    """Replica `replica`'s vLLM engine of `model` on this process's GPU, in the spec's dtype; `options`
    are the recipe's generation.vllm settings (`GenerationConfig.engine_options`). Built by
    `vlmrun.generation.open_generator`."""

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
        if not str(device).startswith("cuda"):
            raise ValueError(f"the vllm backend runs on a CUDA device, not {device!r} (generation.backend: hf)")
        if model.directory is None:
            raise ValueError("the vllm backend opens a model directory (random init happens in the policy)")
        self.spec, self.replica, self.options = model, replica, dict(options or {})
        self.weights_from_refit = weights_from_refit
        self.weights_dtype = model.dtype
        self._seed: int | None = None
        self._calls = 0
        self._asleep = False

    def setup(self) -> dict[str, Any]:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(
                "generation.backend: vllm needs the vllm package on the node (the `vllm` extra, or the "
                "container's image); or set generation.backend: hf"
            ) from e
        self.tokens = SpecialTokens.of_directory(self.spec.directory)
        self.eos_ids, self.pad_token_id = list(self.tokens.eos_ids), self.tokens.pad_token_id
        self.llm = vllm.LLM(
            model=self.spec.directory,
            dtype=self.spec.dtype,
            seed=0,  # every request carries its own seed (module doc, 3)
            tensor_parallel_size=1,
            load_format="dummy" if self.weights_from_refit else "auto",
            enable_sleep_mode=True,
            enable_mm_embeds=True,
            logprobs_mode="raw_logprobs",
            **self.options,
        )
        (params,) = self.llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
        if self.weights_from_refit:
            self.release_weights()  # filled by the first refit
        return {"replica": self.replica, "params": params, "image_token_id": self.tokens.image_token_id}

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, sampling: SamplingParams, *, n: int) -> Rollouts:
        from vllm import SamplingParams as EngineSampling

        if self._asleep:
            raise RuntimeError("the engine's weights were released (generation.release_weights): refit it first")
        if n < 1 or len(prompts) == 0:
            raise ValueError(f"generate needs at least one prompt and n >= 1, got {len(prompts)} prompts and n={n}")
        t0 = time.perf_counter()
        greedy = sampling.temperature == 0
        if not greedy:
            if sampling.seed != self._seed:
                self._seed, self._calls = sampling.seed, 0
            call, self._calls = self._calls, self._calls + 1
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        batch = select_prompts(prompts, rows, self.tokens.image_token_id)
        per_prompt = engine_requests(prompts, self.tokens.image_token_id, self._image_embeds(prompts))
        requests = [per_prompt[i] for i in rows]
        params = [
            EngineSampling(
                **sampling_options(
                    sampling,
                    None if greedy else response_seed(sampling.seed, call, prompts.sample_ids[i], g),
                    self.tokens,
                )
            )
            for i in range(len(prompts))
            for g in range(n)
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return rollouts_from(outputs, batch, n=n, tokens=self.tokens, generate_s=time.perf_counter() - t0)

    def _image_embeds(self, prompts: PromptBatch) -> list[dict | None]:
        """Each prompt's images through the engine's vision tower, {image_embeds, image_grid_thw} (or
        None for a text-only prompt): our processor's pixel rows, on the engine's device and dtype."""
        media = prompt_media(prompts, self.tokens.image_token_id)
        if not any(media):
            return [None] * len(media)

        @torch.no_grad()
        def encode(model: torch.nn.Module) -> list[dict | None]:  # in this process (module doc, 1)
            device, dtype = next(model.parameters()).device, model.visual.dtype
            out: list[dict | None] = []
            for m in media:
                if not m:
                    out.append(None)
                    continue
                grid = m["image_grid_thw"]
                pixels = m[ROWS_KEY].to(device=device, dtype=dtype)
                parts = model._process_image_input(
                    {"type": "pixel_values", "pixel_values": pixels, "image_grid_thw": grid}
                )
                out.append({"image_embeds": torch.cat(list(parts)), "image_grid_thw": grid})
            return out

        (embeds,) = self.llm.apply_model(encode)
        return embeds

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        buckets = [weights] if isinstance(weights, Mapping) else weights
        self.llm.apply_model(lambda model: refit_model(model, buckets))  # in this process: no copy of a bucket
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def release_weights(self) -> None:
        if not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "calls" not in state:
            raise ValueError("this checkpoint's sampling state is another generation backend's (generation.backend)")
        self._seed, self._calls = state["seed"], state["calls"]

    def shutdown(self) -> None:
        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()
