"""Generation throughput of a tiny model: bare `generate` vs the `hf` generator in process vs in a Ray actor.

    .venv/bin/python tools/measure_generation.py --family qwen2_5_vl --prompts 8 --n 4 --max-new-tokens 32

Prints one JSON object. Every row generates the same batch (the prompts of a small generated CLEVR
set, each repeated n times) with the same number of CPU threads; tokens are rows x steps (the batch
runs until its longest response ends). "bare generate" is transformers' own sampling (no log-probs);
the generator comes from the product's factory (`vlmrun.generation.open_generator`, in this process and
in one Ray actor); the actor row gives the time inside the actor and the round trip seen by the caller. The three ways run round-robin, so each `*_over_bare` ratio is the median of per-round
ratios with its spread (vlmrun.observe.ratios). Ray is started here, private to this process
(address="local"), and shut down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vlmrun.generation.interface import SamplingParams
from vlmrun.observe.ratios import ratio_spread, round_ratios


def prompt_batch(family: str, model_dir: Path, work: Path, prompts: int, image_size: int = 64):
    """The first `prompts` validation prompts of an `image_size` px CLEVR set built under `work`, as
    validation reads them."""
    from vlmrun.config.load import validate
    from vlmrun.data.loader import val_batches
    from vlmrun.datasets.clevr import generate_clevr, read_complete

    data = work / f"clevr-{image_size}"
    if read_complete(data) is None:
        generate_clevr(data, train=8, val=max(prompts, 8), image_size=image_size, seed=0)
    recipe = validate(
        {
            "name": "measure-generation",
            "model": {"family": family, "tiny": True},
            "data": {"path": str(data), "num_workers": 0, "max_seq_len": 256},
            "train": {"micro_batch_size": 1, "global_batch_size": 1},
            "parallel": {"dp": 1},
        }
    )
    prompt_batches = val_batches(
        recipe, processor_dir=str(model_dir), samples=prompts, batch_size=prompts
    ).prompt_batches
    return prompt_batches[0]


def measure(*, family: str, work: Path, prompts: int, n: int, max_new_tokens: int, repeats: int, threads: int) -> dict:
    """Time the three ways round-robin, `repeats` rounds after one warm-up round; medians per way."""
    from vlmrun.cluster.ray.local import start_local_ray
    from vlmrun.models.tiny import ensure_tiny_model

    torch.set_num_threads(threads)
    model_dir = ensure_tiny_model(family, work / "models", seed=0)
    batch = prompt_batch(family, model_dir, work, prompts)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    start_local_ray(f"measure-generation-{os.getpid()}", threads)  # loopback only, private to this process
    import ray

    try:
        ways = {
            "bare generate": _bare(model_dir, batch, sampling, n),
            "HfGenerator in process": _in_process(model_dir, batch, sampling, n),
            "HfGenerator in a Ray actor": _in_actor(model_dir, batch, sampling, n, threads),
        }
        times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ways}
        for round_ in range(repeats + 1):
            for name, run in ways.items():
                result = run()
                if round_:
                    times[name].append(result)
    finally:
        ray.shutdown()
    rows = [_row(name, results) for name, results in times.items()]
    bare, in_process, actor = ([r[2] / r[0] for r in times[name]] for name in ways)
    actor_round_trip = [r[2] / r[1] for r in times["HfGenerator in a Ray actor"]]
    return {
        "family": family,
        "prompts": prompts,
        "n": n,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "repeats": repeats,
        "rows": rows,
        "in_process_over_bare": ratio_spread(round_ratios(in_process, bare)),
        "actor_over_bare": ratio_spread(round_ratios(actor, bare)),
        "actor_round_trip_over_bare": ratio_spread(round_ratios(actor_round_trip, bare)),
    }


def _row(where: str, results: list[tuple[float, float, int]]) -> dict:
    """`results`: (seconds generating, seconds seen by the caller, tokens) per round."""
    inside, outside = statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)
    tokens = results[-1][2]
    row = {"where": where, "seconds": round(inside, 4), "tokens": tokens, "tokens_per_s": round(tokens / inside, 1)}
    if outside != inside:
        row |= {"round_trip_s": round(outside, 4), "round_trip_tokens_per_s": round(tokens / outside, 1)}
    return row


def _bare(model_dir: Path, batch, sampling: SamplingParams, n: int):
    from transformers import AutoModelForImageTextToText

    from vlmrun.generation.prompts import select_prompts

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    rows = select_prompts(batch, [i for i in range(len(batch)) for _ in range(n)], model.config.image_token_id)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=sampling.max_new_tokens)

    @torch.no_grad()
    def run():
        t0 = time.perf_counter()
        out = model.generate(**rows.model_inputs(), **kwargs)
        s = time.perf_counter() - t0
        return s, s, out.shape[0] * (out.shape[1] - rows.input_ids.shape[1])

    return run


def _in_process(model_dir: Path, batch, sampling: SamplingParams, n: int):
    from vlmrun.generation import open_generator
    from vlmrun.models.spec import ModelSpec

    g = open_generator("hf", model=ModelSpec(directory=str(model_dir)))
    g.setup()

    def run():
        t0 = time.perf_counter()
        out = g.generate(batch, sampling, n=n)
        s = time.perf_counter() - t0
        return s, s, out.response_ids.numel()

    return run


def _in_actor(model_dir: Path, batch, sampling: SamplingParams, n: int, threads: int):
    import ray

    class Engine:  # defined here so that Ray ships it by value: tools/ is not on the workers' path
        def __init__(self, directory: str, threads: int):
            from vlmrun.generation import open_generator
            from vlmrun.models.spec import ModelSpec

            self.engine = open_generator("hf", model=ModelSpec(directory=directory), threads=threads)

        def setup(self) -> dict:
            return self.engine.setup()

        def generate(self, batch, sampling: SamplingParams, n: int):
            return self.engine.generate(batch, sampling, n=n)

    actor = ray.remote(Engine).options(num_cpus=threads).remote(str(model_dir), threads)
    ray.get(actor.setup.remote())

    def run():
        t0 = time.perf_counter()
        out = ray.get(actor.generate.remote(batch, sampling, n))
        return out.generate_s, time.perf_counter() - t0, out.response_ids.numel()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for the data set, model and Ray (default: temp)"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="vlmrun-measure-") as tmp:
        result = measure(
            family=args.family,
            work=args.work or Path(tmp),
            prompts=args.prompts,
            n=args.n,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            threads=args.threads,
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
