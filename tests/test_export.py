"""`vlmrun export`: a trained run's checkpoints (the session's `finished_run`) become Hugging Face model
directories that load with the logits of the trained model, and bad input is refused by name. That a
recipe starts from an export through `model.path` is every GRPO run's start (test_grpo_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_samples import trained_model, val_batch
from vlmrun_cli import refused, vlmrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exports(finished_run, tmp_path_factory) -> dict[int, dict]:
    """step -> the --json answer of `vlmrun export` (step 2 asked for, into an empty folder that exists;
    step 4 the default: the newest)."""
    base = tmp_path_factory.mktemp("exports")
    (base / "step2").mkdir()
    answers = {}
    for step_args, name in ((["--step", "2"], "step2"), ([], "newest")):
        out = vlmrun("export", str(finished_run), *step_args, str(base / name), "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        answer = json.loads(out.stdout)
        answers[answer["step"]] = answer
    assert sorted(answers) == [2, 4]
    return answers


def test_exports_load_with_the_logits_of_the_trained_model(finished_run, exports):
    from transformers import AutoModelForImageTextToText

    logits = {}
    for step, answer in exports.items():
        out = Path(answer["out"])
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert name in answer["files"], answer["files"]
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == answer["files"]
        trained, model_dir = trained_model(finished_run, step)
        exported = AutoModelForImageTextToText.from_pretrained(out).eval()
        # the export's own processor (tokenizer, chat template, image processor) encodes as the run's did
        batch, reference = val_batch(finished_run, str(out)), val_batch(finished_run, str(model_dir))
        assert torch.equal(batch.input_ids, reference.input_ids)
        assert all(torch.equal(batch.media[k], reference.media[k]) for k in reference.media)
        with torch.no_grad():
            logits[step] = exported(**batch.model_inputs(), use_cache=False).logits
            assert torch.equal(logits[step], trained(**batch.model_inputs(), use_cache=False).logits)
    assert not torch.equal(logits[2], logits[4])


def test_bad_input_exits_2_naming_the_argument(finished_run, exports, tmp_path):
    refused(vlmrun("export", str(tmp_path), str(tmp_path / "out")), "RUN_DIR", "no recipe.yaml")
    refused(vlmrun("export", str(finished_run), "--step", "3", str(tmp_path / "out")), "--step", "2, 4")
    taken = Path(exports[4]["out"])
    refused(vlmrun("export", str(finished_run), str(taken)), "OUT", "not empty")
    assert not (tmp_path / "out").exists()
    assert (Path(exports[2]["out"]) / "model.safetensors").is_file()  # an empty folder that exists is taken
