"""Progress bars for things a person waits on (rich, on stderr so stdout stays parseable)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(description: str, *, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yields `update(done, total)`; draws nothing when disabled or when stderr is not a terminal."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


class ProgressLine:
    """Formats one console line per step: step, loss, tokens/s, ETA (and GRPO's reward and accuracy)."""

    def __init__(self, max_steps: int, cap: str = ""):
        """`cap`: what caps the run below train.max_steps ("train.epochs: 1 caps train.max_steps=20"), said
        beside the step count."""
        self.max_steps, self.t0, self.first = max_steps, time.time(), None
        self.of = f"{max_steps} ({cap})" if cap else str(max_steps)

    def __call__(self, row: dict) -> str:
        step = row["step"]
        if self.first is None:
            self.first, self.t0 = step, time.time()
        done = step - self.first
        rate = (time.time() - self.t0) / done if done > 0 else row.get("step_time_s", 0.0)
        eta = max(0.0, (self.max_steps - step) * rate)
        text = (
            f"step {step}/{self.of} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | "
            f"{row.get('tokens_per_s', 0):.0f} tok/s | ETA {_fmt(eta)}"
        )
        if "reward" in row:
            text += f" | reward {row['reward']:.3f} acc {row['accuracy']:.3f}"
        if "val_accuracy" in row:
            loss = "none (no token scored)" if row.get("val_loss") is None else f"{row['val_loss']:.4f}"
            acc = "none" if row["val_accuracy"] is None else f"{row['val_accuracy']:.3f}"
            text += f" | val_loss {loss} val_acc {acc} (majority baseline {row['val_majority_baseline']:.3f})"
            if _short(row):
                text += f" on {val_scored(row)}"
        return text


def val_scored(row: dict) -> str:
    """How many val samples a validation row scored: 'N val samples', or 'N of M val samples asked for
    (D dropped)' when the val split ran out before M usable ones were found."""
    scored = f"{row['val_samples']} val samples"
    if not _short(row):
        return scored
    dropped = row.get("val_dropped_samples", 0)
    return f"{row['val_samples']} of {row['val_samples_requested']} val samples asked for ({dropped} dropped)"


def _short(row: dict) -> bool:
    return row.get("val_samples", 0) < row.get("val_samples_requested", 0)


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
