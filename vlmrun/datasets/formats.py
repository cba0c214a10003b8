"""The sample formats vlmrun's data sets are written in, as Energon subflavors the cookers select on."""

from __future__ import annotations

from types import MappingProxyType

#: One-image (or text-only) conversations with the answer as the assistant turn (datasets/clevr.py writes
#: them; the `conversation` cooker in vlmrun/data/cookers.py reads them).
CONVERSATION_SUBFLAVORS = MappingProxyType({"format": "vlmrun-conversation"})
