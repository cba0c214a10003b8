"""`vlmrun eval TARGET`: a run's checkpoint, or a model directory, scored on a validation split as the
run's own validation scores it.

1. TARGET is a run directory (its newest checkpoint that verifies, or `--step N`) or a model directory.
   A checkpoint is first exported by `vlmrun export`'s own path (launch/export.py) into a temporary
   folder in the user's vlmrun cache ($XDG_CACHE_HOME/vlmrun/eval: an evaluation reads a run and writes
   nothing into it, so a read-only run directory evaluates too): the export's logits equal the
   trained model's bit for bit. A model
   directory written by `vlmrun export` takes the recipe of the run it came from (its
   vlmrun_export.json names it); any other one needs `--recipe`. `--set` changes that recipe.
2. The data are the recipe's (data.path, data.val_split, train.val_samples) unless --data, --split or
   --samples say otherwise, read by the run's own `val_batches`: the same batches in the same order.
3. The scoring is the run's own (algorithms/common/validation.py): `validation_shares` over the run's
   replicas (parallel.dp) and `evaluate` per share, summed in replica order as the run sums them, in
   one process with one CPU thread, as each of the run's CPU ranks has, so for a run's checkpoint at a
   step where it validated, every number equals that metrics row's (`run_row`, `matches_run_row`).
4. Beyond the run's row: accuracy per question template (records that name one, as CLEVR's do), and
   the greedy answers' reward by the recipe's reward terms (grpo.rewards, or grpo.reward), the mean of
   the total and of each term.
5. `--against TARGET2`: both scored on the same data (TARGET's), and the differences (B - A).

Login-node side, like `vlmrun export`: torch and transformers are imported when an evaluation runs, on
CPU (or this machine's GPU when the recipe asks for GPUs and one is here), the whole model in one
process.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.launch.export import EXPORT_RECORD, export_checkpoint
from vlmrun.run.directory import RunDirectory

#: The metrics row's validation keys that an evaluation reproduces.
ROW_KEYS = ("val_loss", "val_accuracy", "val_samples", "val_tokens", "val_majority_baseline", "val_dropped_samples")


def eval_target(
    target: str | Path,
    *,
    step: int | None = None,
    recipe_path: Path | None = None,
    overrides: list[str] = (),
    data: Path | None = None,
    split: str | None = None,
    samples: int | None = None,
    threads: int = 1,
) -> dict:
    """The scores of `target` (module doc); InputError naming TARGET, --step, --recipe, --data, --split or
    --samples where one does not fit."""
    with _resolved(Path(target), step, recipe_path, list(overrides)) as (recipe, model_dir, record):
        recipe = _with_data(recipe, data, split, samples)
        scores = score_model(recipe, model_dir, samples=recipe.train.val_samples, threads=threads)
    result = record | scores
    row = result.pop("run_row", None)
    as_run = data is None and split is None and samples is None and not overrides  # the run's own validation
    result["run_row"] = row if as_run else None
    result["matches_run_row"] = all(row.get(k) == scores[k] for k in ROW_KEYS) if as_run and row else None
    return result


def compare_evals(a: dict, b: dict) -> dict:
    """Two evaluations side by side, and B - A of every number both have."""
    delta = {
        k: b[k] - a[k] for k in ROW_KEYS if isinstance(a.get(k), int | float) and isinstance(b.get(k), int | float)
    }
    if a.get("reward") and b.get("reward"):
        delta["reward"] = b["reward"]["mean"] - a["reward"]["mean"]
    return {"a": a, "b": b, "delta": delta}


# ---- what is evaluated ---------------------------------------------------------------------------


@contextlib.contextmanager
def _resolved(target: Path, step: int | None, recipe_path: Path | None, overrides: list[str]) -> Iterator[tuple]:
    """(recipe, model directory, what the result records of the target) while the evaluation runs."""
    if (target / "recipe.yaml").is_file():
        with _checkpoint_model(target, step, recipe_path, overrides) as resolved:
            yield resolved
        return
    if step is not None:
        raise InputError("--step", step, message=f"--step: {target} is a model directory, not a run; drop --step")
    if not (target / "config.json").is_file():
        raise InputError(
            "TARGET",
            str(target),
            message=f"TARGET: {target} is neither a run directory (recipe.yaml) nor a model directory (config.json)",
        )
    recipe = _model_recipe(target, recipe_path, overrides)
    yield recipe, target, {"target": str(target), "kind": "model", "model_dir": str(target)}


@contextlib.contextmanager
def _checkpoint_model(run: Path, step: int | None, recipe_path: Path | None, overrides: list[str]) -> Iterator[tuple]:
    from vlmrun.config.load import load_recipe
    from vlmrun.run.metrics import history

    if recipe_path is not None:
        raise InputError("--recipe", str(recipe_path), message="--recipe: TARGET is a run; it evaluates with its own")
    from vlmrun.data.check import cache_dir

    rd = RunDirectory(run)
    recipe = load_recipe(rd.path / "recipe.yaml", overrides)
    exports = cache_dir() / "eval"
    exports.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{rd.path.name}-", dir=exports) as tmp:
        exported = export_checkpoint(rd.path, Path(tmp) / "model", step=step)
        rows = history(rd.metrics_file(recipe)) if rd.metrics_file(recipe).is_file() else {}
        row = rows.get(exported.step, {})
        record = {
            "target": str(rd.path),
            "kind": "checkpoint",
            "step": exported.step,
            "skipped_checkpoints": exported.skipped,
            "run_row": {k: row.get(k) for k in ROW_KEYS} if "val_loss" in row else None,
        }
        model = recipe.model.model_copy(update={"tiny": False, "path": str(exported.out)})
        yield recipe.model_copy(update={"model": model}), exported.out, record


def _model_recipe(model_dir: Path, recipe_path: Path | None, overrides: list[str]):
    """The recipe a model directory is evaluated with: --recipe, or that of the run it was exported from."""
    from vlmrun.config.load import load_recipe
    from vlmrun.models.source import check_model_source

    if recipe_path is None:
        try:
            record = json.loads((model_dir / EXPORT_RECORD).read_text())
            recipe_path = Path(record["run_dir"]) / "recipe.yaml"
        except (OSError, ValueError, KeyError, TypeError):
            raise InputError(
                "--recipe",
                None,
                message=f"--recipe: {model_dir} was not written by `vlmrun export` (no readable {EXPORT_RECORD}); "
                "name the recipe whose data and settings to evaluate with",
            ) from None
        if not recipe_path.is_file():
            raise InputError(
                "--recipe", None, message=f"--recipe: the run {model_dir} was exported from is gone ({recipe_path})"
            )
    recipe = load_recipe(recipe_path, [*overrides, "model.tiny=false", f"model.path={model_dir.resolve()}"])
    check_model_source(recipe.model)
    return recipe


def _with_data(recipe, data: Path | None, split: str | None, samples: int | None):
    """The recipe with --data, --split and --samples; InputError when it would score nothing."""
    from vlmrun.data.splits import split_size

    d = recipe.data.model_copy(
        update={k: v for k, v in {"path": str(data.resolve()) if data else None, "val_split": split}.items() if v}
    )
    if data is not None:
        d = d.model_copy(update={"synthetic": None})
    wanted = samples if samples is not None else recipe.train.val_samples
    if wanted <= 0:
        raise InputError(
            "--samples",
            wanted,
            message=f"--samples: {wanted}: the recipe validates no sample (train.val_samples); give --samples N",
        )
    try:
        split_size(d.path, d.val_split)
    except InputError as e:
        field = "--data" if e.field == "data.path" else "--split"
        raise InputError(field, e.value, message=f"{field}: {e}") from None
    train = recipe.train.model_copy(update={"val_samples": wanted})
    return recipe.model_copy(update={"data": d, "train": train})


# ---- scoring ------------------------------------------------------------------------------------


def score_model(recipe, model_dir: Path, *, samples: int, threads: int = 1) -> dict:
    """The run's validation of the model in `model_dir` on `samples` samples of the recipe's val split
    (module doc)."""
    import torch
    from transformers.utils import logging as hf_logging

    from vlmrun.algorithms.common.rank_backends import rank_threads
    from vlmrun.algorithms.common.validation import ValidationScore, evaluate, validation_row, validation_shares
    from vlmrun.data.loader import val_batches

    threads = rank_threads(recipe, threads)  # as a run's rank computes
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # the command prints the scores; load bars would be noise on stderr
    val = val_batches(
        recipe, processor_dir=str(model_dir), samples=samples, batch_size=max(1, recipe.train.micro_batch_size)
    )
    with _engine_ray(recipe):
        policy, engine, decode = _open(recipe, model_dir, threads)
        answers = _Answers(recipe, engine.eos_ids)
        try:
            shares = validation_shares(val.loss_batches, val.prompt_batches, recipe.parallel.dp)
            scores = [
                evaluate(share, policy=policy, generator=engine, decode=decode, on_answers=answers.add)
                for share in _unpadded(shares)
            ]
        finally:
            engine.shutdown()
            policy.shutdown()
    references = [a for b in val.prompt_batches for a in b.answers]
    row = validation_row(sum(scores, ValidationScore()), references, dropped=val.dropped, requested=samples)
    return {
        "family": recipe.family,
        "data": str(Path(recipe.data.path)),
        "split": recipe.data.val_split,
        **asdict(row),
        **answers.summary(),
    }


@contextlib.contextmanager
def _engine_ray(recipe):
    """A private local Ray for the command while an engine that runs as a Ray actor (vllm: a process of
    its own, on vLLM's torch) is open; nothing for an engine in this process (hf)."""
    if recipe.generation.backend != "vllm":
        yield
        return
    from vlmrun.cluster.ray.local import start_local_ray, stop_local_ray

    start_local_ray(f"eval-{os.getpid()}", 1)
    try:
        yield
    finally:
        stop_local_ray()


def _unpadded(shares: list) -> list:
    """The shares without their padding forwards (they keep a sharded run's collectives in step; here
    there are none)."""
    from vlmrun.algorithms.common.validation import ValidationShare

    return [ValidationShare(s.loss_batches, s.prompt_batches) for s in shares]


def _open(recipe, model_dir: Path, threads: int):
    """(policy, generation engine, decode) of the model, as a run's rank opens them (rank_backends.py),
    in this process: the whole model, one replica."""
    import torch
    from transformers import AutoTokenizer

    from vlmrun.algorithms.common.rank_backends import open_rank_engine, open_rank_policy, rank_threads
    from vlmrun.algorithms.common.validation import response_texts

    gpu = recipe.cluster.gpus_per_node > 0 and torch.cuda.is_available()
    policy = open_rank_policy(recipe, model_dir, rank=0, world_size=1, parallel=None, gpus=gpu)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=max(1, recipe.train.max_steps))
    engine = open_rank_engine(recipe, model_dir, gpus=gpu, threads=rank_threads(recipe, threads))
    engine.setup()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return policy, engine, lambda rollouts: response_texts(tokenizer, rollouts)


class _Answers:
    """Every greedy answer, by question template, and its reward by the recipe's reward terms."""

    def __init__(self, recipe, eos_ids: list[int]):
        from vlmrun.rewards.terms import reward_terms

        self.terms, self.eos_ids, self.format_reward = reward_terms(recipe.grpo), eos_ids, recipe.grpo.format_reward
        self.templates: dict[str, list[int]] = {}
        self.rewards: list[float] = []
        self.parts: dict[str, list[float]] = {}

    def add(self, texts: list[str], prompts, rollouts) -> None:
        from vlmrun.algorithms.grpo.rollout_rows import ended_with
        from vlmrun.rewards.terms import score_responses

        templates = prompts.templates or [""] * len(texts)
        for text, answer, template in zip(texts, prompts.answers, templates, strict=True):
            counts = self.templates.setdefault(template or "(none)", [0, 0])
            counts[0] += text.strip() == answer.strip()
            counts[1] += 1
        samples = [{"answer": a, "sample_id": s} for a, s in zip(prompts.answers, prompts.sample_ids, strict=True)]
        ended = ended_with(rollouts, self.eos_ids)
        for scored in score_responses(self.terms, texts, samples, ended, format_reward=self.format_reward):
            self.rewards.append(scored.reward)
            for name, value in scored.parts.items():
                self.parts.setdefault(name, []).append(value)

    def summary(self) -> dict:
        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        return {
            "templates": {
                t: {"correct": c, "answered": n, "accuracy": c / n} for t, (c, n) in sorted(self.templates.items())
            },
            "reward": {
                "mean": mean(self.rewards),
                "terms": {name: mean(v) for name, v in sorted(self.parts.items())},
                "fn": [t.fn_path for t in self.terms],
            },
        }
