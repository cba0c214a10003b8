"""The `hf` generation backend: transformers `generate` on one replica, with our own sampler.

1. `generate` runs in greedy mode with one logits processor, `TokenSampler`, that does the sampling
   itself: it reads the raw logits of each step (the model's own, nothing applied before it), records
   the log-prob of the token it draws under them, and draws from the suppressed, temperature-scaled,
   top-p-filtered distribution with the replica's own `torch.Generator`. So the log-probs match a
   training forward, the RNG is ours to save and restore (no global RNG is touched), and memory
   stays one [N, vocab] step (transformers' `output_logits` would keep every step's logits).
2. The model's saved generation config is replaced by one holding only its token ids: a real
   checkpoint's `generation_config.json` (Qwen2.5-VL ships top_k=1, temperature=0.1,
   repetition_penalty=1.05) must not change what `SamplingParams` says; transformers' own default
   top_k=50 would apply to any sampling left to it.
3. Tokens the saved config suppresses and the model's placeholder tokens (image, video, audio) are
   never drawn: a response holding a placeholder would break the forward that re-reads it.
4. Each prompt is repeated `n` times (prompts.py) before `generate`: the rollouts carry those rows
   anyway, and `num_return_sequences` is refused in greedy mode. Its images go into the prefill once,
   their features read by its n rows (models/shared_images.py; `share_images=False`: n copies, each
   through the vision tower, as tools/bench_vision.py compares).
5. Greedy sampling (`temperature=0`, validation's answers) draws nothing: it neither starts nor moves
   the replica's sampling stream, so validating between GRPO steps leaves their responses as they were.
6. With `policy_model` the engine has no model of its own: it generates with the policy's (interface.py,
   6). A sharded (FSDP2) model keeps its decoder layers sharded, each gathered for its forward as in
   training; its root (embeddings, head, media towers) is gathered for the call, because transformers
   runs the vision tower outside the model's forward, where FSDP2 gathers nothing; and every rank
   takes as many forward passes as the slowest (`synced_gpus`), since each pass gathers collectively.
   The per-token log-probs stay on the device until the call ends (one copy, not one a token).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from vlmrun.config.dtype import torch_dtype
from vlmrun.data.batch import PromptBatch
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.generation.prompts import select_prompts, shared_prompt_media
from vlmrun.generation.rollouts import Rollouts, response_mask
from vlmrun.generation.special_tokens import SpecialTokens
from vlmrun.models.build import build_model, materialize_buffers
from vlmrun.models.shared_images import vision_once
from vlmrun.models.spec import ModelSpec


class HfGenerator(GenerationBackend):
    """Replica `replica` of the transformers model of `model`, in this process (CPU or one GPU), in the
    spec's dtype. Built by `vlmrun.generation.open_generator`."""

    def __init__(
        self,
        *,
        model: ModelSpec,
        replica: int = 0,
        device: str = "cpu",
        threads: int | None = None,
        weights_from_refit: bool = False,
        share_images: bool = True,
        policy_model: torch.nn.Module | None = None,
    ):
        self.spec, self.replica, self.device, self.threads = model, replica, device, threads
        self.share_images = share_images
        self.weights_from_refit = weights_from_refit
        self.weights_dtype = model.dtype
        self._seed: int | None = None
        self._generator: torch.Generator | None = None
        self._released: dict[torch.nn.Parameter, torch.Size] | None = None  # release_weights: what to allocate again
        self._policy_model = policy_model
        self.reads_policy_weights = policy_model is not None

    def setup(self) -> dict[str, Any]:
        from transformers import GenerationConfig

        if self.threads:
            torch.set_num_threads(self.threads)
        if self.reads_policy_weights:  # module doc
            self.model = self._policy_model
        elif self.weights_from_refit:  # nothing read: buffers computed, parameters left to the first refit
            self.model = build_model(self.spec, device=self.device, on_meta=True).eval()
            materialize_buffers(self.model, torch.device(self.device))
        else:
            self.model = build_model(self.spec, device=self.device).to(self.device).eval()
        self.tokens = SpecialTokens.of(self.model.config, self.model.generation_config)
        self.eos_ids, self.pad_token_id = list(self.tokens.eos_ids), self.tokens.pad_token_id
        self.image_token_id, self.never_generated = self.tokens.image_token_id, list(self.tokens.never_generated)
        self.token_ids = self.tokens.generation_ids()
        self.model.generation_config = GenerationConfig(**self.token_ids)
        params = sum(p.numel() for p in self.model.parameters())
        if self.weights_from_refit and not self.reads_policy_weights:
            self.release_weights()  # allocated again, and filled, by the first refit
        return {"replica": self.replica, "params": params, "image_token_id": self.image_token_id}

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, sampling: SamplingParams, *, n: int) -> Rollouts:
        from transformers import GenerationConfig, LogitsProcessorList

        if self._released is not None:
            raise RuntimeError("the engine's weights were released (generation.release_weights): refit it first")
        if n < 1 or len(prompts) == 0:
            raise ValueError(f"generate needs at least one prompt and n >= 1, got {len(prompts)} prompts and n={n}")
        t0 = time.perf_counter()
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        batch = select_prompts(prompts, rows, self.image_token_id)
        stream = None if sampling.temperature == 0 else self._stream(sampling.seed)  # module doc
        sampler = TokenSampler(sampling, stream, self.never_generated)
        inputs, source = batch.model_inputs(), None
        if self.share_images and n > 1:  # module doc
            media, source = shared_prompt_media(prompts, rows, self.image_token_id)
            inputs.update(media)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if self.reads_policy_weights:  # pixels in the compute dtype, as the policy's own forward casts them
            compute = torch_dtype(self.weights_dtype)
            inputs = {k: v.to(compute) if v.is_floating_point() else v for k, v in inputs.items()}
        config = GenerationConfig(**self.token_ids, do_sample=False, max_new_tokens=sampling.max_new_tokens)
        with vision_once(self.model, source), _root_gathered(self.model):
            sequences = self.model.generate(
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=self.reads_policy_weights and _world_size() > 1,
            ).cpu()
        responses = sequences[:, batch.input_ids.shape[1] :]
        mask = response_mask(responses, self.eos_ids)
        return Rollouts.sampled(
            batch,
            n=n,
            response_ids=responses,
            mask=mask,
            logprobs=sampler.logprobs(responses.shape[1]),
            pad_token_id=self.pad_token_id,
            generate_s=time.perf_counter() - t0,
        )

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        """Copy each bucket into the model's own tensors as it comes (cast to their dtype, moved to their
        device): no second copy of the model, whatever the bucket size (the interface doc)."""
        own = self.refit_targets()
        aliases: dict[int, list[str]] = {}  # a tied weight: one tensor under several names, filled once
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        alias_of = {n: names for names in aliases.values() for n in names}
        came: set[str] = set()
        filled: set[str] = set()
        for bucket in [weights] if isinstance(weights, Mapping) else weights:
            for name, tensor in bucket.items():
                target = own.get(name)
                if target is None or name in came:
                    raise KeyError(
                        f"refit: {name!r} {'came twice' if target is not None else 'is not a weight of the engine'}"
                    )
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"refit: {name!r} has shape {tuple(tensor.shape)}, the engine's {tuple(target.shape)}"
                    )
                came.add(name)
                if name in filled:  # another name of the same tied tensor filled it already
                    continue
                if tensor.data_ptr() != target.data_ptr():  # else the policy wrote it in place
                    target.copy_(tensor)
                filled.update(alias_of.get(name, [name]))
            # before the next is drawn: the policy gathers it with this one freed, its last tensor too
            bucket = tensor = None
        if missing := sorted(set(own) - filled):
            raise KeyError(f"refit: {len(missing)} weights never came, e.g. {missing[:3]}")

    def refit_targets(self) -> dict[str, torch.Tensor]:
        """The model's own tensors by name (weights released: allocated again first, to be filled)."""
        for param, shape in (self._released or {}).items():
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self._released = None
        return self.model.state_dict()

    def release_weights(self) -> None:
        """Every parameter's storage freed (the module, shapes and dtypes kept; buffers stay: they are
        small and the refit does not bring the non-persistent ones)."""
        if self._released is not None or self.reads_policy_weights:  # the policy's weights are not ours
            return
        self._released = {}
        for param in self.model.parameters():  # a tied weight is one parameter: freed once, filled once
            self._released[param] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "generator": None if self._generator is None else self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seed, self._generator = state["seed"], None
        if state["generator"] is not None:
            self._generator = torch.Generator(device=self.device)
            self._generator.set_state(state["generator"])

    def shutdown(self) -> None:
        self.model = None
        if str(self.device).startswith("cuda"):
            torch.cuda.empty_cache()  # the weights' blocks go back to the training that shares the GPU

    def _stream(self, seed: int) -> torch.Generator:
        """The replica's generator for `seed`: continued when the seed is the last one, else started afresh."""
        if self._generator is None or seed != self._seed:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(stream_seed(seed, self.replica))
            self._seed = seed
        return self._generator


class TokenSampler:
    """A logits processor that draws the next token itself (see the module docstring, 1).

    Returns scores that are -inf except at the drawn token, so greedy `generate` takes it. Keeps the
    log-prob of every drawn token under the raw logits, one [N] tensor per step.
    """

    def __init__(self, sampling: SamplingParams, generator: torch.Generator | None, never: list[int]):
        self.sampling, self.generator, self.never = sampling, generator, never
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raw = scores.float()
        allowed = raw.clone()
        allowed[:, self.never] = -float("inf")
        if self.sampling.temperature == 0:
            token = allowed.argmax(dim=-1)
        else:
            probs = torch.softmax(top_p_filter(allowed / self.sampling.temperature, self.sampling.top_p), dim=-1)
            token = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        self.steps.append(torch.log_softmax(raw, dim=-1).gather(1, token[:, None]).squeeze(1))
        forced = torch.full_like(scores, -float("inf"))
        return forced.scatter_(1, token[:, None], 0.0)

    def logprobs(self, length: int) -> torch.Tensor:
        """[N, length] on the CPU: the first `length` steps (generate may run a step it then drops)."""
        return torch.stack(self.steps[:length], dim=1).cpu()


@contextlib.contextmanager
def _root_gathered(model: torch.nn.Module) -> Iterator[None]:
    """A sharded (FSDP2) model's root unit gathered for the block, and sharded again after it (module
    doc); any other model as it is."""
    if not hasattr(model, "unshard"):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` with -inf outside the smallest set of tokens whose probability reaches `top_p` (as HF's)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[:, -1] = False  # keep at least the most likely token
    return logits.masked_fill(drop.scatter(1, order, drop), -float("inf"))


def stream_seed(seed: int, replica: int) -> int:
    """A 64-bit seed for replica `replica` of a run seeded `seed`; distinct pairs give unrelated streams."""
    return int(np.random.SeedSequence([seed, replica]).generate_state(1, np.uint64)[0])
