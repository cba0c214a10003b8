"""Tiny random-init models of the supported VLM families, built offline on CPU.

Each builder writes a complete Hugging Face model directory: config and weights (random init from
`torch.manual_seed(seed)`), a byte-level BPE tokenizer trained offline, the family's processor and
a chat template. Load it back the standard way, offline:

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)

Every family maps to `AutoModelForImageTextToText` (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`, `NemotronH_Omni_Reasoning_V3`);
the three Qwen families share tokenizer, template and processor layout (qwen.py). The text of a
one-image user turn comes from
`processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
"text": question}]}], add_generation_prompt=True)`.

Practical warnings:
1. The saved generation config suppresses the image/video placeholder and role tokens: an untrained
   model that emits a placeholder would break the next forward with that response ("N features for
   M placeholder tokens"). Generation log-probs taken from the processed scores are renormalized
   over the remaining tokens; take them from the raw logits to match a training forward.
2. `return_assistant_tokens_mask=True` is right for the Qwen families only: Nemotron's processor drops
   the text offsets of its image expansion (transformers 5.24), so its mask lands on image tokens.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from vlmrun.config.families import family_spec

# Bump when a builder changes what it writes, so caches built by older code are not reused.
BUILD_FORMAT = 1
MARKER_FILE = "vlmrun_tiny.json"

logger = logging.getLogger(__name__)


def family_module(family: str):
    """The builder module of `family` (`create(seed=...)`, `build(out_dir, seed=...)`, `CHAT_TEMPLATE`, ...).

    Raises InputError on `model.family` for a family the registry (vlmrun/config/families.py) lacks;
    tests/test_tiny_models.py checks every registered family has a builder.
    """
    import importlib

    return importlib.import_module(f"vlmrun.models.tiny.{family_spec(family).name}")


def build_tiny_model(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny `family` model directory into `out_dir` (created if missing, must be empty).

    Deterministic: the same family and seed give identical weights and processor files. Not atomic;
    use `ensure_tiny_model` for a directory that other processes may read. Raises `InputError` for an
    unknown family and `FileExistsError` for a non-empty `out_dir`.
    """
    module = family_module(family)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; a tiny model is built into an empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    module.build(out_dir, seed=seed)
    _write_marker(out_dir, family, seed)
    return out_dir


def ensure_tiny_model(family: str, cache_dir: Path, *, seed: int = 0) -> Path:
    """Return the cached tiny `family` model under `cache_dir`, building it on first use.

    The model is built in a hidden temporary directory and renamed into place, so the returned path
    is always complete; concurrent callers (several ranks) may each build, the first rename wins and
    the others use its copy. `cache_dir` must be on a filesystem every caller sees.
    """
    family_module(family)
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{family}-seed{seed}-v{BUILD_FORMAT}"
    if _is_complete(final, family, seed):
        return final
    if final.exists():
        raise FileExistsError(f"{final} exists but holds no complete tiny model (no {MARKER_FILE}); delete it")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        build_tiny_model(family, tmp, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it private to this user
        try:
            os.rename(tmp, final)
            logger.info("built tiny %s model (seed %d) in %s", family, seed, final)
        except OSError:
            if not _is_complete(final, family, seed):
                raise
            logger.info("another process built %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_marker(out_dir: Path, family: str, seed: int) -> None:
    import transformers

    marker = {"family": family, "seed": seed, "format": BUILD_FORMAT, "transformers": transformers.__version__}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _is_complete(path: Path, family: str, seed: int) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("family") == family and marker.get("seed") == seed and marker.get("format") == BUILD_FORMAT
