"""Generation replicas in Ray actors, behind the same `GenerationBackend` interface as one replica.

1. One actor per replica, each holding one instance of the `backend` engine (`generation.backend`)
   built from `init(replica)` (the keyword arguments of `open_generator` but the backend); Ray must be
   running. Replica r samples its own stream (`stream_seed(seed, r)`),
   so the responses depend on the number of replicas, never on timing.
2. `generate` cuts the prompts into contiguous shares, one per replica (the first ones one prompt
   larger), runs them at once and joins the rows in prompt order.
3. `load_weights` puts the weights into the object store once (a mapping, or the buckets of a
   policy's `weights_for_refit` joined there; or it takes an ObjectRef) and every replica reads them
   from there: across processes the weights travel whole, unlike a refit inside the rank's process.
4. `state_dict` holds every replica's sampling stream; it loads only into a group of the same size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vlmrun.data.batch import PromptBatch
from vlmrun.generation import generator_class
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.generation.prompts import select_prompts
from vlmrun.generation.rollouts import Rollouts


class GenerationGroup(GenerationBackend):
    """`replicas` actors of the `backend` engine built from `init(replica)`, each with `num_cpus` CPUs
    and `num_gpus` GPUs. Raises InputError naming `generation.backend` for an unknown backend."""

    def __init__(
        self,
        backend: str,
        init: Callable[[int], dict[str, Any]],
        replicas: int,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
    ):
        import ray

        if replicas < 1:
            raise ValueError(f"a generation group needs at least one replica, got {replicas}")
        remote = ray.remote(generator_class(backend)).options(num_cpus=num_cpus, num_gpus=num_gpus)
        first = init(0)
        self.weights_dtype = first["model"].dtype if "model" in first else self.weights_dtype
        self.actors = [remote.remote(**init(r)) for r in range(replicas)]
        self.image_token_id: int | None = None

    def setup(self) -> dict[str, Any]:
        import ray

        infos = ray.get([a.setup.remote() for a in self.actors])
        self.image_token_id = infos[0]["image_token_id"]
        self._setup_done = True
        return infos[0]

    def generate(self, prompts: PromptBatch, sampling: SamplingParams, *, n: int) -> Rollouts:
        import ray

        if not hasattr(self, "_setup_done"):
            raise RuntimeError("call setup() before generate()")
        shares = [s for s in share_bounds(len(prompts), len(self.actors)) if s[1] > s[0]]
        refs = [
            actor.generate.remote(select_prompts(prompts, range(start, stop), self.image_token_id), sampling, n=n)
            for actor, (start, stop) in zip(self.actors, shares, strict=False)
        ]
        return Rollouts.concat(ray.get(refs))

    def load_weights(self, weights: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        """Every replica takes the same weights from the object store: an ObjectRef of a mapping as it
        is, a mapping or a stream of buckets put there once (the buckets joined, on the CPU)."""
        import ray

        if isinstance(weights, ray.ObjectRef):
            ref = weights
        else:
            buckets = [weights] if isinstance(weights, Mapping) else weights
            ref = ray.put({name: t.detach().cpu() for bucket in buckets for name, t in bucket.items()})
        ray.get([a.load_weights.remote(ref) for a in self.actors])

    def release_weights(self) -> None:
        import ray

        ray.get([a.release_weights.remote() for a in self.actors])

    def state_dict(self) -> dict[str, Any]:
        import ray

        return {"replicas": ray.get([a.state_dict.remote() for a in self.actors])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        saved = state["replicas"]
        if len(saved) != len(self.actors):
            raise ValueError(f"generation state of {len(saved)} replicas cannot load into {len(self.actors)}")
        ray.get([a.load_state_dict.remote(s) for a, s in zip(self.actors, saved, strict=True)])

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)


def share_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous shares of `count` items; the first `count % parts` one larger."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        bounds.append((start, stop))
        start = stop
    return bounds
