"""The tar members of one converted row and the rolling shards of a split (`vlmrun data prepare`).

A row becomes `<key>.json` (its record in the conversation format of `vlmrun.data.cookers`, with the
source row's `id`) and one `<key>.<i>.<ext>` per image: the image's bytes as the source gave them,
after Pillow decoded them once (to refuse what does not decode and to read the size), under the
extension of the format Pillow found. Tar headers are fixed (no mtime, owner or mode of the host), so
the same rows give the same bytes.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from vlmrun.datasets.user_rows import BadRow, ImageSource, Row

#: Pillow's format name -> the member extension the image is stored under.
_EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}


def encode_row(row: Row) -> tuple[dict[str, bytes], int]:
    """The tar members of a row: `json` and one `<i>.<ext>` per image; and how many images it has."""
    members: dict[str, bytes] = {}
    media, refs = [], []
    for i, source in enumerate(row.images):
        try:
            data = source.read()
            ext, width, height = _inspect(data, i, source)
        except BadRow as bad:
            raise bad.of(row.id) from None
        refs.append(f"{i}.{ext}")
        members[refs[-1]] = data
        media.append({"ref": refs[-1], "modality": "image", "width": width, "height": height})
    messages = [
        {
            "role": m["role"],
            "content": [
                {"type": "image", "ref": refs[p["image"]]} if p["type"] == "image" else p for p in m["content"]
            ],
        }
        for m in row.messages
    ]
    record = {"messages": messages, "media": media, "id": row.id}
    members["json"] = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    return members, len(refs)


def _inspect(data: bytes, index: int, source: ImageSource) -> tuple[str, int, int]:
    """(extension, width, height) of encoded image bytes; BadRow (undecodable_image) when Pillow cannot."""
    from PIL import Image, UnidentifiedImageError

    where = f"image {index}" + (f" ({source.path})" if source.path is not None else "")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return _EXTENSIONS.get(image.format, (image.format or "img").lower()), image.width, image.height
    except UnidentifiedImageError:
        raise BadRow("undecodable_image", f"{where} is not an image Pillow can read ({len(data)} bytes)") from None
    except Exception as e:  # noqa: BLE001 - any decoder error (OSError, SyntaxError, bomb) means the same here
        raise BadRow("undecodable_image", f"{where} does not decode: {type(e).__name__}: {e}") from None


class SplitWriter:
    """The shards of one split, `per_shard` samples each, with fixed tar headers (same rows, same bytes)."""

    def __init__(self, folder: Path, split: str, per_shard: int):
        self.folder, self.split, self.per_shard = folder, split, per_shard
        self.samples, self._tar = 0, None

    def add(self, members: dict[str, bytes]) -> None:
        if self.samples % self.per_shard == 0:
            self.close()
            name = f"{self.split}-{self.samples // self.per_shard:06d}.tar"
            self._tar = tarfile.open(self.folder / name, "w", format=tarfile.USTAR_FORMAT)
        key = f"{self.split}-{self.samples:07d}"
        for ext, data in sorted(members.items()):
            add_member(self._tar, f"{key}.{ext}", data)
        self.samples += 1

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """`data` as the member `name`, with a fixed header (no mtime, owner or mode of the host)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))
