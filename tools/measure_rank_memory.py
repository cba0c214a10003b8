"""Host memory of a run's rank processes, measured from outside, on the submit path, as JSON.

    .venv/bin/python tools/measure_rank_memory.py [--layers 16] [--steps 1] [--set section.key=value ...]

Two runs of recipes/tiny-clevr-cpu.yaml through `vlmrun submit --cluster local --wait`, one after the
other: the tiny model, then a random-init model of the Qwen2.5-VL layout with the tiny model's tokenizer
and processor and a wider, deeper language model (`--hidden`, `--layers`; ~181M parameters, 692 MiB in
fp32, at the defaults), saved as bf16 safetensors and trained as fp32 masters. Both with FSDP2 over
dp=2, SGD (no optimizer state), gradients reduce-scattered after every micro-batch, each decoder layer
recomputed in the backward (as every GPU recipe ships; `--set parallel.activation_checkpointing=false`
adds the micro-batch's activations), `--steps` steps, no validation; `--set` goes to both runs. While
each run lasts, every process started under it is polled (/proc, every 50 ms); the rank processes are
Ray's `SftWorker` actors (their loader workers, forked with the same name, left out), and each one's
VmHWM (its peak resident memory over its life) is the last one read. The answer: each rank's peak in
the large run less the same rank's in the tiny run, against the large model's fp32 bytes
(`ratio_to_fp32_model`), and what the step rows said (`peak_rss_mb`). A rank holds 1/dp of the weights
and 1/dp of their gradients between micro-batches (1.0x the model at dp=2), plus what a forward and
backward gather.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
RANK_MARK = "SftWorker"
BASE_SETS = [
    "parallel.fsdp=true",
    "parallel.reduce_every_micro_batch=true",
    "parallel.activation_checkpointing=true",
    "train.optimizer=sgd",
    "train.val_samples=0",
    "logger.wandb_mode=disabled",
    "data.synthetic.train=64",
    "data.synthetic.val=8",
]


def large_model(work: Path, *, hidden: int, layers: int, intermediate: int) -> tuple[Path, int]:
    """A model directory: the tiny Qwen2.5-VL's tokenizer, processor and special tokens, a language model
    of `layers` x `hidden` random-init (bf16 on disk); and its parameter count."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrun.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model("qwen2_5_vl", work / "tiny-cache")
    out = work / f"qwen2_5_vl-{layers}x{hidden}"
    if (out / "model.safetensors").exists():
        config = AutoConfig.from_pretrained(out)
        with torch.device("meta"):
            return out, sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    shutil.rmtree(out, ignore_errors=True)  # a build that stopped half-way
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    config = AutoConfig.from_pretrained(tiny)
    heads, text = hidden // 64, config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, intermediate, layers
    text.num_attention_heads, text.num_key_value_heads = heads, max(1, heads // 4)
    text.layer_types = [text.layer_types[0]] * layers
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[8, 12, 12])  # head_dim 64: sums to 32
    config.vision_config.out_hidden_size = hidden
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
    return parents


def _descendants(root: int, parents: dict[int, int]) -> list[int]:
    kids: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        kids.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out[1:]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _status_kb(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class RankWatch:
    """Polls the processes under `root` until `stop`; per rank process, the last VmHWM read (kB)."""

    def __init__(self, root: int):
        self.root, self.peaks, self.stop = root, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            parents = _parents()
            marked = {pid for pid in _descendants(self.root, parents) if RANK_MARK in _cmdline(pid)}
            for pid in marked - {p for p in marked if parents.get(p) in marked}:  # not a rank's loader worker
                if (hwm := _status_kb(pid, "VmHWM")) is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            self.stop.wait(0.05)

    def done(self) -> list[int]:
        self.stop.set()
        self.thread.join()
        return sorted(self.peaks.values())


def submit(work: Path, name: str, sets: list[str]) -> dict:
    """One run through `vlmrun submit`; its ranks' VmHWM (MB, sorted) and its step rows."""
    run_dir = work / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "vlmrun.cli", "submit", str(RECIPE), "--cluster", "local", "--wait"]
    cmd += ["--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = RankWatch(proc.pid)
    out, _ = proc.communicate()
    peaks = watch.done()
    if proc.returncode:
        raise SystemExit(f"{name}: vlmrun submit exited {proc.returncode}:\n{out[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "ranks_vmhwm_mb": [round(kb / 1024, 1) for kb in peaks],
        "rows_peak_rss_mb": [r["peak_rss_mb"] for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None, help="keep the runs and the model here")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="section.key=value, both runs")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vlmrun-rank-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    model, params = large_model(work, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate)
    sets = [*BASE_SETS, f"data.path={work / 'clevr'}", f"train.max_steps={args.steps}", *args.sets]
    t0 = time.perf_counter()
    tiny = submit(work, "tiny", sets)
    large = submit(work, "large", [*sets, "model.tiny=false", f"model.path={model}"])
    fp32 = params * 4
    if len(large["ranks_vmhwm_mb"]) != len(tiny["ranks_vmhwm_mb"]):
        raise SystemExit(f"the runs showed different rank processes: tiny {tiny}, large {large}")
    above = [a - b for a, b in zip(large["ranks_vmhwm_mb"], tiny["ranks_vmhwm_mb"], strict=True)]
    print(
        json.dumps(
            {
                "model_params": params,
                "model_fp32_mb": round(fp32 / 2**20, 1),
                "tiny": tiny,
                "large": large,
                "above_tiny_mb": [round(x, 1) for x in above],
                "ratio_to_fp32_model": [round(x * 2**20 / fp32, 3) for x in above],
                "sets": sets,
                "seconds": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
