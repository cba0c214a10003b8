"""Real small and read-only file systems, for the tests of what a full disk or a read-only run directory
does: a tmpfs of a given size, a read-only bind mount. Mounting needs root (CI runs as root); where it is
not permitted the test is skipped, saying so. Each is unmounted when its block ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stderr.strip() or f"mount exited {done.returncode}"
        pytest.skip(f"needs a real file system mounted for the test (as root), and `mount {' '.join(args)}`: {why}")


def _unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True)  # a process still holds a file


@contextlib.contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `path` (made when missing) for the block."""
    if shutil.which("mount") is None:
        pytest.skip("needs `mount` to make a small file system")
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _unmount(path)


def grow(disk: Path, size: int) -> None:
    """Give the tmpfs at `disk` `size` bytes (what freeing space does)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True, capture_output=True)


def fill(disk: Path, leave: int = 0) -> Path:
    """A file that takes all of `disk`'s free space but `leave` bytes; its path."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(0, free - leave))
    return filler


@contextlib.contextmanager
def read_only_view(folder: Path, at: Path) -> Iterator[Path]:
    """`folder` seen read-only at `at` (a read-only bind mount) for the block: writes there fail with EROFS,
    root's too."""
    if shutil.which("mount") is None:
        pytest.skip("needs `mount` for a read-only view")
    at.mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(folder), str(at))
    try:
        _mount("-o", "remount,ro,bind", str(at))
        yield at
    finally:
        _unmount(at)
