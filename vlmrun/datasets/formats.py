"""The sample formats vlmrun's data sets are written in, as Energon subflavors the cookers select on."""

from __future__ import annotations

from types import MappingProxyType

#: Conversations with their images (none, one or several) and the answers as assistant turns
#: (datasets/clevr.py and datasets/user_data.py write them; the `conversation` cooker in
#: vlmrun/data/cookers.py reads them).
CONVERSATION_SUBFLAVORS = MappingProxyType({"format": "vlmrun-conversation"})
