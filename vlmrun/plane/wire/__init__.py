"""The multimodal wire: per-sample values <-> flat 1-D rows with their true shapes in the tags.

`codec` turns one field's per-sample values into rows (and back); `jagged` packs rows into the one
torch.nested jagged tensor per field that crosses a backend, and normalizes what a backend returns.
"""

from vlmrun.plane.wire.codec import FieldTag, Pieces, WireError, decode_column, encode_column, join, pack_media
from vlmrun.plane.wire.jagged import rows_of, to_jagged

__all__ = [
    "FieldTag",
    "Pieces",
    "WireError",
    "decode_column",
    "encode_column",
    "join",
    "pack_media",
    "rows_of",
    "to_jagged",
]
