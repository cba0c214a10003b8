"""Plain functions the data-path tests share (the fixtures are in tests/conftest.py): the size of the
session's CLEVR set, a tiny recipe over a data set, batches as plain data, and raw and damaged samples;
and one rank of the recipe's policy on a layout, started in processes of their own (the spawned-rank tests
of FSDP2).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

from vlmrun.config.families import FAMILIES as FAMILY_REGISTRY

TRAIN, VAL, SIZE, PER_SHARD = 96, 24, 64, 32  # the session's CLEVR set (conftest.clevr_set)
FAMILIES = tuple(FAMILY_REGISTRY)


def make_recipe(data_path: Path | str, *, family: str = "qwen2_5_vl", train: dict | None = None, dp: int = 1, **data):
    """A validated tiny recipe over `data_path` at `dp` replicas; keyword arguments override `data.*`."""
    from vlmrun.config.load import validate

    raw = {
        "name": "data-test",
        "model": {"family": family, "tiny": True},
        "data": {
            "path": str(data_path),
            "num_workers": 0,
            "shuffle_buffer": 16,
            "max_samples_per_sequence": 8,
            "max_seq_len": 256,
            **data,
        },
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "seed": 1234, **(train or {})},
        "parallel": {"dp": dp},
        "cluster": {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 2},
    }
    return validate(raw)


def flat(batch) -> dict:
    """A batch as plain data for equality checks and torch.save."""
    return {
        "ids": list(batch.sample_ids),
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "labels": batch.labels,
        **{f"t.{k}": v for k, v in batch.token_inputs.items()},
        **{f"m.{k}": v for k, v in batch.media.items()},
    }


def same_batches(got: list[dict], want: list[dict]) -> bool:
    import torch

    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if g.keys() != w.keys() or g["ids"] != w["ids"]:
            return False
        if not all(torch.equal(g[k], w[k]) for k in w if k != "ids"):
            return False
    return True


def read_raw_samples(folder: Path, split: str) -> dict[str, dict]:
    """key -> crude sample (raw bytes per extension), as Energon hands it to a cooker."""
    samples: dict[str, dict] = {}
    for shard in sorted(Path(folder).glob(f"{split}-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {"__key__": key, "__restore_key__": ()})[ext] = tar.extractfile(member).read()
    return samples


def write_corrupt_copy(src: Path, out: Path, damage: dict[str, Callable[[dict], dict]]) -> Path:
    """Copy a CLEVR set sample by sample, applying `damage[key](members)`, then prepare it for Energon."""
    from vlmrun.datasets.clevr import SPLITS
    from vlmrun.datasets.energon_prepare import prepare_crude_webdataset
    from vlmrun.datasets.formats import CONVERSATION_SUBFLAVORS

    out.mkdir(parents=True)
    for shard in sorted(Path(src).glob("*.tar")):
        with tarfile.open(shard) as tar_in, tarfile.open(out / shard.name, "w", format=tarfile.USTAR_FORMAT) as tar_out:
            samples: dict[str, dict[str, bytes]] = {}
            for member in tar_in:
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {})[ext] = tar_in.extractfile(member).read()
            for key, members in samples.items():
                members = damage.get(key, lambda m: m)(dict(members))
                for ext, data in sorted(members.items()):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar_out.addfile(info, io.BytesIO(data))
    patterns = {split: rf"{split}-[0-9]+\.tar$" for split in SPLITS}
    prepare_crude_webdataset(out, split_patterns=patterns, subflavors=dict(CONVERSATION_SUBFLAVORS))
    return out


def without_messages(members: dict) -> dict:
    record = json.loads(members["json"])
    del record["messages"]
    return {**members, "json": json.dumps(record).encode()}


def with_long_question(members: dict, words: int = 300) -> dict:
    """The sample with its question padded to more than 256 tokens: its prompt does not fit."""
    return _edit_text(members, "user", " and".join([""] * words))


def with_long_answer(members: dict, words: int = 300) -> dict:
    """The sample with its answer followed by more than 256 tokens: a conversation to cut, a prompt that fits."""
    return _edit_text(members, "assistant", " because" * words)


def _edit_text(members: dict, role: str, extra: str) -> dict:
    record = json.loads(members["json"])
    message = next(m for m in record["messages"] if m["role"] == role)
    text = next(part for part in message["content"] if part["type"] == "text")
    text["text"] += extra
    return {**members, "json": json.dumps(record).encode()}


def text_only(members: dict) -> dict:
    """The sample as a text-only conversation: its image part and its image member removed."""
    record = json.loads(members["json"])
    for message in record["messages"]:
        message["content"] = [part for part in message["content"] if part["type"] == "text"]
    record["media"] = []
    return {k: v for k, v in members.items() if k != "jpg"} | {"json": json.dumps(record).encode()}


def free_port() -> int:
    """A loopback port nothing listens on now (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every rank process of the spawned-rank tests imports: loaded once per pytest process, in its
#: forkserver, instead of once per rank (torch, transformers and the model classes: ~3 s of CPU a rank).
RANK_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    *(f"transformers.models.{f}.modeling_{f}" for f in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")),
    "vlmrun.policy.hf",
    "vlmrun.data.loader",
)


def start_ranks(main: Callable, args: tuple, nprocs: int = 2) -> None:
    """`main(rank, *args)` in `nprocs` fresh processes, to their end (an exception in one is raised here).

    Forked from the pytest process's forkserver, which imported RANK_PRELOAD once: each rank starts as a
    fresh process would (no state of the test process, no threads, no process group) without importing
    torch and transformers again."""
    import multiprocessing

    import torch.multiprocessing as mp

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    mp.start_processes(main, args=args, nprocs=nprocs, start_method="forkserver")


def rank_policy(recipe, rank: int, world: int, model_dir: str, layout: dict, port: int, max_steps: int = 20):
    """Rank `rank` of `world` of the recipe's policy over `model_dir`, its `parallel` section updated with
    `layout` (e.g. {"fsdp": True}) and dp=world, set up; returns (policy, what `setup` said)."""
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    policy = open_policy(
        recipe.model.backend,
        model=ModelSpec(directory=model_dir, dtype=recipe.model.dtype),
        rank=rank,
        world_size=world,
        train=recipe.train,
        parallel=recipe.parallel.model_copy(update={"dp": world, **layout}),
    )
    info = policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=max_steps)
    return policy, info


def trained_model(run: Path, step: int):
    """(model, its model directory): the model run `run` trained to checkpoint `step`, built as the run
    builds it (its model directory plus the checkpoint's weights), in eval mode."""
    from transformers import AutoModelForImageTextToText

    from vlmrun.checkpoint.read import Checkpoint, verify
    from vlmrun.checkpoint.store import CheckpointStore
    from vlmrun.models.source import ensure_model
    from vlmrun.run.directory import RunDirectory

    rd = RunDirectory(run)
    recipe = rd.load_recipe()
    path = dict(CheckpointStore(rd.checkpoints(recipe), keep=2).complete())[step]
    checkpoint = Checkpoint(step, path, verify(path))
    model_dir = ensure_model(recipe.model, rd.cache, recipe.train.seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.load_state_dict(checkpoint.read("model"))
    return model.eval(), model_dir


def val_batch(run: Path, processor_dir: str, samples: int = 3):
    """The first `samples` validation conversations of the run's data set, encoded for the run's family
    by the processor in `processor_dir`, as one batch."""
    from vlmrun.config.families import family_spec
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import cook_conversation
    from vlmrun.data.loader import load_processor
    from vlmrun.run.directory import RunDirectory

    recipe = RunDirectory(run).load_recipe()
    raw = read_raw_samples(Path(recipe.data.path), "val")
    encoder = ConversationEncoder(load_processor(processor_dir, recipe.family), family_spec(recipe.family), 256)
    return encoder.collate([encoder.encode(cook_conversation(raw[k])) for k in sorted(raw)[:samples]])
