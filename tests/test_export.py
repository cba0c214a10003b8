"""`vlmrun export`: a trained run's checkpoints become Hugging Face model directories that load with the
logits of the trained model, refuse bad input by name, and start a new run through `model.path`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_samples import read_raw_samples

from vlmrun.algorithms.common.checkpoint import Checkpoint, verify
from vlmrun.algorithms.common.checkpoint_store import CheckpointStore
from vlmrun.models.source import ensure_model
from vlmrun.run.directory import RunDirectory

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-clevr-cpu.yaml")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def vlmrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )


def small(base: Path, steps: int) -> list[str]:
    sets = [
        f"data.path={base / 'clevr'}",
        "data.synthetic={train: 64, val: 8, image_size: 64, seed: 0}",
        f"train.max_steps={steps}",
        "checkpoint.save_period=2",
        "train.val_samples=0",
        "logger.wandb_mode=disabled",
    ]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A tiny run that completed 4 steps, with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("export") / "run"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), "--wait", *small(run.parent, 4))
    assert out.returncode == 0, out.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def exports(finished, tmp_path_factory) -> dict[int, dict]:
    """step -> the --json answer of `vlmrun export` (step 2 asked for, step 4 the default: the newest)."""
    base = tmp_path_factory.mktemp("exports")
    answers = {}
    for step_args, name in ((["--step", "2"], "step2"), ([], "newest")):
        out = vlmrun("export", str(finished), *step_args, str(base / name), "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        answer = json.loads(out.stdout)
        answers[answer["step"]] = answer
    assert sorted(answers) == [2, 4]
    return answers


def checkpoint_model(run: Path, step: int):
    """The trained model at `step`, built as the run builds it: its model dir plus the checkpoint's weights."""
    from transformers import AutoModelForImageTextToText

    rd = RunDirectory(run)
    recipe = rd.load_recipe()
    path = dict(CheckpointStore(rd.checkpoints(recipe), keep=2).complete())[step]
    checkpoint = Checkpoint(step, path, verify(path))
    model_dir = ensure_model(recipe.model, rd.cache, recipe.train.seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.load_state_dict(checkpoint.read("model"))
    return model.eval(), model_dir


def a_batch(run: Path, processor_dir: str):
    from vlmrun.config.families import family_spec
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import cook_conversation
    from vlmrun.data.loader import load_processor

    raw = read_raw_samples(run.parent / "clevr", "val")
    encoder = ConversationEncoder(load_processor(processor_dir, "qwen2_5_vl"), family_spec("qwen2_5_vl"), 256)
    return encoder.collate([encoder.encode(cook_conversation(raw[k])) for k in sorted(raw)[:3]])


def test_exports_load_with_the_logits_of_the_trained_model(finished, exports):
    from transformers import AutoModelForImageTextToText

    logits = {}
    for step, answer in exports.items():
        out = Path(answer["out"])
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert name in answer["files"], answer["files"]
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == answer["files"]
        trained, model_dir = checkpoint_model(finished, step)
        exported = AutoModelForImageTextToText.from_pretrained(out).eval()
        # the export's own processor (tokenizer, chat template, image processor) encodes as the run's did
        batch, reference = a_batch(finished, str(out)), a_batch(finished, str(model_dir))
        assert torch.equal(batch.input_ids, reference.input_ids)
        assert all(torch.equal(batch.media[k], reference.media[k]) for k in reference.media)
        with torch.no_grad():
            logits[step] = exported(**batch.model_inputs(), use_cache=False).logits
            assert torch.equal(logits[step], trained(**batch.model_inputs(), use_cache=False).logits)
    assert not torch.equal(logits[2], logits[4])


def one_line_refusal(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and 1 <= len(out.stderr.strip().splitlines()) <= 2, out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_bad_input_exits_2_naming_the_argument(finished, exports, tmp_path):
    one_line_refusal(vlmrun("export", str(tmp_path), str(tmp_path / "out")), "RUN_DIR", "no recipe.yaml")
    one_line_refusal(vlmrun("export", str(finished), "--step", "3", str(tmp_path / "out")), "--step", "2, 4")
    taken = Path(exports[4]["out"])
    one_line_refusal(vlmrun("export", str(finished), str(taken)), "OUT", "not empty")
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert vlmrun("export", str(finished), "--step", "2", str(empty)).returncode == 0
    assert (empty / "model.safetensors").is_file()


def test_a_recipe_starts_from_an_export(finished, exports, tmp_path):
    export = exports[4]["out"]
    start = ["--set", f"model.path={export}", "--set", "model.tiny=false", *small(finished.parent, 2)]
    dry = vlmrun("submit", TINY, "--dry-run", "--json", *start, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    run = tmp_path / "from-export"
    out = vlmrun("submit", TINY, "--cluster", "local", "--run-dir", str(run), "--wait", *start)
    assert out.returncode == 0, out.stderr[-2000:]
    job = json.loads((run / "job.json").read_text())
    assert job["state"] == "COMPLETED"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not (run / "cache" / "models").exists()  # no tiny model was built: the run used the export
