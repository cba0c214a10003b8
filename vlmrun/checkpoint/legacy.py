"""The checkpoint formats before the current one, where reading them differs from it.

Every reader goes through these tables, so the current code never spells an old layout:

- Format 1, written before the layered layout: the manifest is `meta.json`; the policy's parts are
  `model.pt` and `optim.pt` and the controller's `controller.pt` at the top of the folder; a loader
  shard's file `loader/shard_<r>.pt` holds the loader's and the data plane's state under the keys
  "loader" and "plane". Its manifest names no run, no identity and no algorithm.
- Format 2: format 3's layout, each file's checksum recorded as sha256.
- Format 3: the current layout but the controller's part, `controller.pt` (torch.save), whose RNG state
  holds numpy's and torch's beside python's (the controller never drew from either: only python's is
  restored).

Checkpoints of every format up to 4 written before exact epochs record no loader format: their runs read
loader format 1 (vlmrun.data.fingerprint), and continue to.
"""

from __future__ import annotations

import hashlib
from typing import Any

from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, PARTS

#: The loader format of a checkpoint whose manifest records none.
UNRECORDED_LOADER_FORMAT = 1
#: Format 1's manifest.
V1_MANIFEST = "meta.json"
#: Checksums that older manifests record, by the key of a file's entry (format 2: sha256).
CHECKSUMS = {"sha256": hashlib.sha256}

_V1_PARTS = {
    "controller": "controller.pt",
    MODEL_PART: "model.pt",
    OPTIMIZER_PART: "optim.pt",
    "rng": "rng/rank_{index}.pt",
    "loader": "loader/shard_{index}.pt",
    "plane": "loader/shard_{index}.pt",
}
# Format 1's parts that share one file, and the key each sits under in it.
_V1_KEYS = {"loader": "loader", "plane": "plane"}
_V3_PARTS = PARTS | {"controller": "controller.pt"}
_LAYOUTS = {1: _V1_PARTS, 2: _V3_PARTS, 3: _V3_PARTS}


def layout(fmt: int) -> dict[str, str]:
    """Part -> file for a checkpoint of format `fmt` (the current layout for the current format)."""
    return _LAYOUTS.get(fmt, PARTS)


def unpack(fmt: int, part: str, state: Any) -> Any:
    """The state of `part` from what its file holds (format 1 kept two parts in one file)."""
    if fmt == 1 and part in _V1_KEYS:
        return state[_V1_KEYS[part]]
    return state
