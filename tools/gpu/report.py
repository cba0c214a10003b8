"""A GPU check's JSON report: printed, and written to its file (`--out`, or $OUT/<name> when $OUT is set:
what tools/gpu/run_checks.sh collects)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_report(report: dict, out: Path | None, name: str) -> Path | None:
    """Print `report` as JSON and write it to `out`, or to $OUT/`name`; the path written, if any."""
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / name
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)
    return out
