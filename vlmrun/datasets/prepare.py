"""Make sure a recipe's data set exists before a job starts (generate the synthetic one on first use)."""

from __future__ import annotations

from pathlib import Path

from vlmrun.errors import InputError


def ensure_dataset(data, progress=None) -> Path:
    """`data` is the recipe's DataConfig. Returns the dataset path, ready for Energon.

    A set that `vlmrun data prepare` wrote at data.path is used as it is, also when the recipe names a
    synthetic one (data.synthetic makes a set only where there is none).
    """
    path = Path(data.path)
    if generated_by_job(data):
        from vlmrun.datasets.clevr import ensure_clevr

        s = data.synthetic
        ensure_clevr(path, train=s.train, val=s.val, image_size=s.image_size, seed=s.seed, progress=progress)
    elif not (path / ".nv-meta").is_dir():
        raise InputError(
            "data.path",
            str(path),
            "must be an Energon-prepared dataset folder (with .nv-meta/); "
            "make one with `vlmrun data prepare`, `vlmrun data clevr` or `energon prepare`, or set data.synthetic",
        )
    return path


def generated_by_job(data) -> bool:
    """The job generates the set at data.path (data.synthetic, and no set of `vlmrun data prepare` there)."""
    return data.synthetic is not None and not _prepared_by_user(Path(data.path))


def _prepared_by_user(path: Path) -> bool:
    from vlmrun.datasets.user_data import read_prepared

    return read_prepared(path) is not None
