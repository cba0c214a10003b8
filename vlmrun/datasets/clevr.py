"""Synthetic CLEVR-style VQA data set as Energon-ready WebDataset shards.

On disk (`out/`):

    train-000000.tar ...  samples <key>.jpg (or .png) + <key>.json, key "train-0000042"
    val-000000.tar ...
    *.tar.idx             Energon's per-shard offset index
    .nv-meta/             Energon metadata (CrudeWebdataset, subflavors = CONVERSATION_SUBFLAVORS)
    clevr.json            parameters, summary and file sizes; written last: marks a complete set

The same arguments give byte-identical shards on every run (for one Pillow/libjpeg build): each
sample draws from its own generator seeded by (seed, split, index), and tar members carry fixed
metadata. `ensure_clevr` is what a training job calls; `generate_clevr` is the worker.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image

from vlmrun.datasets.clevr_scene import Question, draw_scene, sample_question, sample_scene
from vlmrun.datasets.conversation_shards import add_member
from vlmrun.datasets.energon_prepare import META_FOLDER, prepare_crude_webdataset
from vlmrun.datasets.formats import CONVERSATION_SUBFLAVORS
from vlmrun.datasets.marker import read_marker, write_marker
from vlmrun.errors import InputError

SPLITS = ("train", "val")
IMAGE_FORMATS = ("jpg", "png")
MARKER = "clevr.json"
_JPEG_QUALITY = 90
_MIN_IMAGE_SIZE, _MAX_IMAGE_SIZE = 48, 1024
_FORMAT_VERSION = 1

Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class ClevrParams:
    """Everything that decides the bytes of a generated set."""

    train: int
    val: int
    image_size: int
    seed: int
    image_format: str = "jpg"
    samples_per_shard: int = 256

    def validate(self) -> None:
        """Raise `InputError` naming the first argument out of range."""
        for field in ("train", "val", "samples_per_shard"):
            if getattr(self, field) < 1:
                raise InputError(field, getattr(self, field), "must be at least 1")
        if not _MIN_IMAGE_SIZE <= self.image_size <= _MAX_IMAGE_SIZE:
            allowed = f"must be between {_MIN_IMAGE_SIZE} and {_MAX_IMAGE_SIZE} pixels"
            raise InputError("image_size", self.image_size, allowed)
        if self.image_format not in IMAGE_FORMATS:
            raise InputError("image_format", self.image_format, f"allowed: {', '.join(IMAGE_FORMATS)}")


@dataclass(frozen=True)
class SplitSummary:
    """What one split holds; `majority_accuracy` is the score of always answering the majority."""

    samples: int
    answers: dict[str, int]
    templates: dict[str, int]
    majority_answer: str
    majority_accuracy: float

    @classmethod
    def from_counts(cls, answers: Counter[str], templates: Counter[str]) -> SplitSummary:
        samples = sum(answers.values())
        # Ties go to the smallest answer in sort order, so the summary is reproducible.
        majority, count = max(sorted(answers.items(), key=_answer_order), key=lambda kv: kv[1])
        return cls(
            samples=samples,
            answers=dict(sorted(answers.items(), key=_answer_order)),
            templates=dict(sorted(templates.items())),
            majority_answer=majority,
            majority_accuracy=count / samples,
        )


@dataclass(frozen=True)
class ClevrSummary:
    """The result of generating (or finding) a set: where it is, how it was made, what it holds."""

    path: Path
    params: ClevrParams
    splits: dict[str, SplitSummary]

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "params": asdict(self.params),
            "splits": {name: asdict(split) for name, split in self.splits.items()},
        }

    @classmethod
    def from_json(cls, data: dict, path: Path) -> ClevrSummary:
        splits = {name: SplitSummary(**split) for name, split in data["splits"].items()}
        return cls(path=path, params=ClevrParams(**data["params"]), splits=splits)


def generate_clevr(
    out: Path,
    *,
    train: int,
    val: int,
    image_size: int = 112,
    seed: int = 0,
    image_format: str = "jpg",
    samples_per_shard: int = 256,
    progress: Progress | None = None,
) -> ClevrSummary:
    """Write a complete set into `out` (missing or empty) and prepare it for Energon.

    Not atomic: a crash leaves a partial folder without `clevr.json`; use `ensure_clevr` for a
    folder that other jobs read. `progress(done, total)` is called after every sample, in the
    calling thread. Raises `InputError` for an argument out of range or a non-empty `out`.
    """
    params = ClevrParams(
        train=train,
        val=val,
        image_size=image_size,
        seed=seed,
        image_format=image_format,
        samples_per_shard=samples_per_shard,
    )
    params.validate()
    out = Path(out)
    _make_empty_dir(out)
    total = train + val
    splits: dict[str, SplitSummary] = {}
    done = 0
    for split in SPLITS:
        splits[split] = _write_split(out, split, params, done, total, progress)
        done += splits[split].samples
    patterns = {split: rf"{split}-[0-9]+\.tar$" for split in SPLITS}
    prepare_crude_webdataset(out, split_patterns=patterns, subflavors=dict(CONVERSATION_SUBFLAVORS))
    summary = ClevrSummary(path=out, params=params, splits=splits)
    _write_marker(out, summary)
    return summary


def _make_empty_dir(out: Path) -> None:
    """Create `out` (with its parents) or accept it empty; InputError naming `out` for anything else."""
    if out.exists() and not out.is_dir():
        raise InputError("out", str(out), message=f"out: {out} is a file; give a directory that is missing or empty")
    try:
        if out.is_dir() and any(out.iterdir()):
            raise InputError("out", str(out), "must be missing or empty")
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cannot_make(out, e) from None


def _cannot_make(out: Path, e: OSError) -> InputError:
    """The error for a folder that cannot be made: a parent is a file, or not writable."""
    file = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    why = f"{file} is a file" if file is not None else e.strerror or str(e)
    return InputError("out", str(out), message=f"out: cannot make {out}: {why}")


def ensure_clevr(
    out: Path,
    *,
    train: int,
    val: int,
    image_size: int,
    seed: int,
    image_format: str = "jpg",
    progress: Progress | None = None,
) -> ClevrSummary:
    """Return the set at `out`, generating it first when `out` is missing or incomplete.

    Generation happens in a hidden sibling folder that is renamed to `out` when complete, so a
    crash never leaves a set that looks complete. Raises `InputError` naming the parameter when
    `out` holds a complete set made with other parameters, or naming `out` when it holds files
    that are not a CLEVR set (those are never deleted). Call it from one process (rank 0) while
    the others wait: concurrent callers still end with one complete set, but may replace each
    other's copy while it is being read.
    """
    params = ClevrParams(train=train, val=val, image_size=image_size, seed=seed, image_format=image_format)
    params.validate()
    out = Path(out)
    found = read_complete(out)
    if found is None:
        _check_replaceable(out)
        found = _generate_and_rename(out, params, progress)
    _check_same_params(out, params, found.params)
    return found


def read_complete(out: Path) -> ClevrSummary | None:
    """The summary of the complete set at `out`, or None when `out` is missing or incomplete."""
    summary = read_marker(Path(out), MARKER, _FORMAT_VERSION)
    try:
        return None if summary is None else ClevrSummary.from_json(summary, Path(out))
    except (ValueError, KeyError, TypeError, AttributeError):  # not ours
        return None


def sample_key(split: str, index: int) -> str:
    return f"{split}-{index:07d}"


def shard_name(split: str, shard_index: int) -> str:
    return f"{split}-{shard_index:06d}.tar"


def _write_split(
    out: Path, split: str, params: ClevrParams, done: int, total: int, progress: Progress | None
) -> SplitSummary:
    count = getattr(params, split)
    answers: Counter[str] = Counter()
    templates: Counter[str] = Counter()
    per_shard = params.samples_per_shard
    for shard_index, start in enumerate(range(0, count, per_shard)):
        with tarfile.open(out / shard_name(split, shard_index), "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(start, min(start + per_shard, count)):
                members, question = _render_sample(split, index, params)
                for name, data in sorted(members.items()):
                    add_member(tar, name, data)
                answers[question.answer] += 1
                templates[question.template] += 1
                done += 1
                if progress is not None:
                    progress(done, total)
    return SplitSummary.from_counts(answers, templates)


def _render_sample(split: str, index: int, params: ClevrParams) -> tuple[dict[str, bytes], Question]:
    # A string seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    rng = random.Random(f"vlmrun-clevr/{params.seed}/{split}/{index}")
    objects = sample_scene(rng, params.image_size)
    question = sample_question(rng, objects)
    ref = params.image_format
    record = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "ref": ref}, {"type": "text", "text": question.text}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": question.answer}]},
        ],
        "media": [
            {
                "ref": ref,
                "modality": "image",
                "width": params.image_size,
                "height": params.image_size,
            }
        ],
        "template": question.template,
        "scene": [obj.to_json() for obj in objects],
    }
    key = sample_key(split, index)
    members = {
        f"{key}.{ref}": _encode_image(draw_scene(objects, params.image_size), ref),
        f"{key}.json": json.dumps(record, separators=(",", ":")).encode(),
    }
    return members, question


def _encode_image(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    if image_format == "jpg":
        # 4:4:4 chroma keeps small objects' colors true; Pillow writes no EXIF or timestamps.
        image.save(buffer, format="JPEG", quality=_JPEG_QUALITY, subsampling=0)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


def _answer_order(item: tuple[str, int]) -> tuple[bool, int, str]:
    answer = item[0]
    return (not answer.isdigit(), int(answer) if answer.isdigit() else 0, answer)


def _write_marker(out: Path, summary: ClevrSummary) -> None:
    data = summary.to_json()
    data.pop("path")
    write_marker(out, MARKER, _FORMAT_VERSION, data)


def _check_same_params(out: Path, wanted: ClevrParams, recorded: ClevrParams) -> None:
    for field in ("train", "val", "image_size", "seed", "image_format"):
        if getattr(wanted, field) != getattr(recorded, field):
            raise InputError(
                field,
                getattr(wanted, field),
                f"{out} holds a CLEVR set made with {field}={getattr(recorded, field)!r}; "
                "pass that value or choose another directory",
            )


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a path unless it is an empty folder or holds only what we write."""
    if not out.exists():
        return
    ours = out.is_dir() and all(
        p.name in (MARKER, META_FOLDER) or (p.name.startswith(SPLITS) and p.name.endswith((".tar", ".tar.idx")))
        for p in out.iterdir()
    )
    if not ours:
        raise InputError("out", str(out), "exists and is not a CLEVR data set; choose another directory")


def _generate_and_rename(out: Path, params: ClevrParams, progress: Progress | None) -> ClevrSummary:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise _cannot_make(out, e) from None
    try:
        generate_clevr(staging, progress=progress, **asdict(params))
        if read_complete(out) is None:
            # An incomplete leftover (checked by _check_replaceable) makes way for the new set.
            shutil.rmtree(out, ignore_errors=True)
            try:
                os.rename(staging, out)
            except OSError:
                # Another process finished the same set first: keep theirs if it is complete.
                if read_complete(out) is None:
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    found = read_complete(out)
    if found is None:
        raise RuntimeError(f"{out} is incomplete right after generating it")
    return found
