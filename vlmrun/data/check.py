"""`vlmrun data check`: every sample of the splits a run reads, encoded as the run's loader encodes it.

1. The samples are read in index order straight from the split's tar files (WebDataset's member
   grouping, as Energon's), cooked by the recipe's first cooker and encoded by the recipe's own task
   encoder (vlmrun.data.task_encoder: SFT conversations with labels, GRPO prompts; validation both,
   with GRPO's answer room), so a sample is sorted exactly as the loader would sort it: ok (`truncated`
   among them: cut at data.max_seq_len with its media and an answer token kept), unfit
   (`SampleUnfit`: too_long, media_cut, no_label, media_mismatch), or corrupt (anything else the loader
   would skip: an image that does not decode, a record that does not parse).
2. The verdict is what the run would do. Unfit samples under `data.on_bad_sample: refuse` stop the
   run at the first one it meets; under `drop` they count against `data.error_tolerance` with the
   corrupt ones. The training split is spread over parallel.dp loader shards with a budget each, so
   more bad samples than error_tolerance x dp fail some shard within the first epoch (fewer may still
   fail one shard: the check says so, it cannot know Energon's slices). Validation reads one shard,
   in order, up to train.val_samples usable samples; only those it reads count.
3. `vlmrun submit` runs the check where data.path is a prepared set and the processor is at hand
   (data.check_at_submit). Its result is cached under the user's cache folder, keyed by the data
   set's index and tar files (names, sizes, modification times), the processor's files and chat
   template, and every recipe field that changes an encoding or the verdict; a second submit of the
   same data reads the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vlmrun.data.splits import split_shards
from vlmrun.errors import InputError

logger = logging.getLogger(__name__)

#: Bump when the check's sorting or its cached record changes.
CHECK_FORMAT = 1
#: Sample ids named per kind.
FIRST = 5
CORRUPT = "corrupt"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class SplitCheck:
    """What one split holds, by kind, and what of it the run reads (`read_*`)."""

    split: str
    role: str  # "train" or "val"
    samples: int = 0
    ok: int = 0
    truncated: int = 0
    bad: dict[str, int] = field(default_factory=dict)  # kind -> count (SampleUnfit kinds, and corrupt)
    first: dict[str, list[str]] = field(default_factory=dict)  # kind -> "key: why" of the first FIRST
    read_unfit: int = 0
    read_corrupt: int = 0

    @property
    def unfit(self) -> int:
        return sum(n for kind, n in self.bad.items() if kind != CORRUPT)

    def add(
        self, key: str, kind: str | None, why: str = "", *, truncated: bool = False, read: bool = True, row=None
    ) -> None:
        """Count one sample; a bad one among the first FIRST of its kind is named "key (row ID): why"."""
        self.samples += 1
        if kind is None:
            self.ok += 1
            self.truncated += truncated
            return
        self.bad[kind] = self.bad.get(kind, 0) + 1
        named = self.first.setdefault(kind, [])
        if len(named) < FIRST:
            label = f"{key} (row {row})" if row else key
            named.append(f"{label}: {why.removeprefix(f'{key}: ')}")
        if read:
            self.read_corrupt += kind == CORRUPT
            self.read_unfit += kind != CORRUPT


@dataclass
class DataCheck:
    """The check of one data set against one recipe; `problems` is what would stop the run (empty: fits)."""

    path: str
    family: str
    max_seq_len: int
    on_bad_sample: str
    error_tolerance: int
    loader_shards: int
    splits: list[SplitCheck]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cached: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        for split, record in zip(self.splits, out["splits"], strict=True):
            record["unfit"] = split.unfit
        return out

    @classmethod
    def from_json(cls, record: dict) -> DataCheck:
        record = {k: v for k, v in record.items() if k not in ("ok",)}
        splits = [SplitCheck(**{k: v for k, v in s.items() if k != "unfit"}) for s in record.pop("splits")]
        return cls(splits=splits, **record)


def check_data(recipe, *, processor_dir: str, progress: Callable[[int, int], None] | None = None) -> DataCheck:
    """Sort every sample of the splits `recipe` reads and judge them (module doc).

    Raises InputError (data.path, data.split, data.val_split, model.family) where the data set or processor
    cannot be read.
    """
    from vlmrun.data.loader import load_processor

    d = recipe.data
    roles, shards = read_splits(recipe)
    total = sum(n for split in shards.values() for _, n in split)
    processor = load_processor(processor_dir, recipe.family)
    done, splits = 0, []
    for role, split in roles:
        check = SplitCheck(split=split, role=role)
        cook, encode = _sample_encoder(recipe, processor, val=role == "val")
        usable_wanted = recipe.train.val_samples if role == "val" else None
        for key, raw in _raw_samples(d.path, shards[split]):
            read = usable_wanted is None or check.ok < usable_wanted
            kind, why, truncated, row = _sort(cook, encode, key, raw)
            check.add(key, kind, why, truncated=truncated, read=read, row=row)
            done += 1
            if progress is not None:
                progress(done, total)
        splits.append(check)
    result = DataCheck(
        path=str(d.path),
        family=recipe.family,
        max_seq_len=d.max_seq_len,
        on_bad_sample=d.on_bad_sample,
        error_tolerance=d.error_tolerance,
        loader_shards=recipe.parallel.dp,
        splits=splits,
    )
    _judge(result)
    return result


def _sample_encoder(recipe, processor, *, val: bool) -> tuple[Callable, Callable]:
    """(cook: raw sample -> Conversation, encode: Conversation -> the task encoder's encoded sample), what
    the loader's workers compute."""
    from vlmrun.data.cookers import COOK_FUNCTIONS
    from vlmrun.data.task_encoder import task_encoder_of

    task_encoder = task_encoder_of(recipe, processor, val=val)
    cook = COOK_FUNCTIONS[recipe.data.cookers[0]]
    return (lambda raw: cook({**raw, "__restore_key__": ()})), task_encoder.encode_sample


def _sort(cook, encode, key: str, raw: dict) -> tuple[str | None, str, bool, str | None]:
    """(kind or None for ok, why, truncated, the source row's id where the record keeps one) of one raw
    sample."""
    from vlmrun.data.chat_encoding import SampleUnfit

    row = None
    try:
        conv = cook(raw)
        row = conv.annotations.get("id")
        encoded = encode(conv)
    except SampleUnfit as e:
        return e.kind, str(e), False, row
    except Exception as e:  # noqa: BLE001 - the loader's error handler skips any exception as a corrupt sample
        return CORRUPT, f"{type(e).__name__}: {e}", False, row
    return None, "", bool(getattr(getattr(encoded, "encoded", None), "truncated", False)), row


def _raw_samples(path: str, shards: list[tuple[str, int]]):
    """(key, raw sample) of each sample of the shards, in index order; InputError on data.path naming a tar
    file that is missing or damaged (the loader would fail on it at once: vlmrun.data.error_budget)."""
    import webdataset as wds

    for name, count in shards:
        tar, seen = Path(path) / name, 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # webdataset warns about defaults we set on purpose
                for raw in wds.WebDataset([str(tar)], shardshuffle=False, empty_check=False):
                    seen += 1
                    yield raw["__key__"], raw
        except (OSError, tarfile.TarError, ValueError) as e:
            raise InputError(
                "data.path", path, message=f"data.path: {tar} cannot be read ({type(e).__name__}: {e})"
            ) from None
        if seen != count:
            raise InputError(
                "data.path",
                path,
                message=f"data.path: {tar} holds {seen} samples, but its index (.nv-meta) counts {count}: prepare the "
                "set again",
            )


def _judge(result: DataCheck) -> None:
    """Fill `problems` (what would stop the run) and `warnings` (what might) (module doc)."""
    tolerance, refuse = result.error_tolerance, result.on_bad_sample == "refuse"
    for s in result.splits:
        where = f"split {s.split!r} ({'training' if s.role == 'train' else 'validation'})"
        if refuse and s.read_unfit:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(s.bad.items()) if kind != CORRUPT)
            result.problems.append(
                f"{where}: {s.read_unfit} sample(s) the run cannot train on ({kinds}); data.on_bad_sample=refuse "
                f"stops the run at the first it meets (first: {_first_unfit(s)}); fix them, or set "
                "data.on_bad_sample=drop"
            )
        bad = s.read_corrupt + (0 if refuse else s.read_unfit)
        shards = result.loader_shards if s.role == "train" else 1
        if bad > tolerance * shards:
            over = "each" if shards > 1 else "its"
            result.problems.append(
                f"{where}: {bad} sample(s) to skip, more than data.error_tolerance={tolerance} for {over} of its "
                f"{shards} loader shard(s): a shard would fail within the first epoch; raise data.error_tolerance "
                "or fix the samples"
            )
        elif bad > tolerance:
            result.warnings.append(
                f"{where}: {bad} sample(s) to skip over {shards} loader shards, more than "
                f"data.error_tolerance={tolerance} for one: a shard that gets more than its share fails"
            )


def _first_unfit(s: SplitCheck) -> str:
    kind = next(k for k in s.bad if k != CORRUPT)
    return s.first[kind][0]


# ---- at submit, cached ----------------------------------------------------------------------------


def cached_check(recipe, processor_dir: str, progress: Callable[[int, int], None] | None = None) -> DataCheck:
    """`check_data`, or its cached result for the same data set, processor and settings (module doc)."""
    key = _cache_key(recipe, processor_dir)
    cached = _read_cache(key)
    if cached is not None:
        return cached
    result = check_data(recipe, processor_dir=processor_dir, progress=progress)
    write_cache(recipe, processor_dir, result)
    return result


def write_cache(recipe, processor_dir: str, result: DataCheck) -> None:
    """Remember `result` for `recipe`'s data set and processor (best effort: a read-only home only costs
    the next submit a check), written atomically."""
    key, folder = _cache_key(recipe, processor_dir), cache_dir() / "data-checks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.")
        with os.fdopen(fd, "w") as f:
            json.dump(result.to_json(), f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError as e:
        logger.info("data check: result not cached in %s (%s)", folder, e)


#: The recipe field that names the split of each role (what a missing split's message names).
_FIELDS = {"train": "data.split", "val": "data.val_split"}


def read_splits(recipe) -> tuple[list[tuple[str, str]], dict[str, list[tuple[str, int]]]]:
    """The (role, split) pairs `recipe` reads (train; val when train.val_samples > 0) and each split's
    shards; InputError naming data.split or data.val_split for a split the data set lacks."""
    d = recipe.data
    roles = [("train", d.split)] + ([("val", d.val_split)] if recipe.train.val_samples > 0 else [])
    return roles, {split: split_shards(d.path, split, field=_FIELDS[role]) for role, split in roles}


def cache_dir() -> Path:
    """The user's vlmrun cache: $XDG_CACHE_HOME/vlmrun (default ~/.cache/vlmrun)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmrun"


def _cache_key(recipe, processor_dir: str) -> str:
    d, t = recipe.data, recipe.train
    meta = Path(d.path) / ".nv-meta"
    files = {}
    roles = {d.split: "train"} | ({d.val_split: "val"} if t.val_samples > 0 and d.val_split != d.split else {})
    for split, role in roles.items():
        for name, count in split_shards(d.path, split, field=_FIELDS[role]):
            st = (Path(d.path) / name).stat()
            files[name] = [count, st.st_size, st.st_mtime_ns]
    import megatron.energon
    import transformers

    identity = {
        "format": CHECK_FORMAT,
        "versions": [transformers.__version__, megatron.energon.__version__],
        "path": str(Path(d.path).resolve()),
        "meta": [(meta / f).read_text() for f in (".info.json", "split.yaml")],
        "files": files,
        "processor": _processor_files_hash(Path(processor_dir)),
        "recipe": [recipe.family, d.split, d.val_split, d.cookers, d.task_encoder, d.max_seq_len, d.on_bad_sample],
        "budget": [d.error_tolerance, recipe.parallel.dp, t.val_samples, t.algorithm, recipe.grpo.max_new_tokens],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _processor_files_hash(folder: Path) -> str:
    """Every file of the model directory but its weights and config.json: processor, tokenizer, template."""
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.suffix not in _WEIGHTS and file.name != "config.json":
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _read_cache(key: str) -> DataCheck | None:
    try:
        record = json.loads((cache_dir() / "data-checks" / f"{key}.json").read_text())
        result = DataCheck.from_json(record)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    result.cached = True
    return result
