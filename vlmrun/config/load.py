"""Load a recipe: YAML file -> dotted `--set` overrides -> validated `Recipe`.

Every failure is an `InputError` that names the field path, the bad value and what is allowed, so
the CLI can print it in one or two lines and exit 2.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vlmrun.config.recipe import CrossFieldError, Recipe
from vlmrun.errors import InputError


def load_recipe(path: str | Path, overrides: list[str] = (), *, base_dir: Path | None = None) -> Recipe:
    """Read, override and validate a recipe; relative paths in it resolve against `base_dir` (cwd)."""
    raw = read_yaml(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    recipe = validate(raw)
    return resolve_paths(recipe, base_dir or Path.cwd())


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputError("RECIPE", str(path), message=f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError("RECIPE", str(path), message=f"{path}{where}: malformed YAML: {problem}") from None
    except UnicodeDecodeError:
        raise InputError("RECIPE", str(path), message=f"{path}: not a text (UTF-8) file") from None
    if not isinstance(data, dict):
        raise InputError(
            "RECIPE", str(path), message=f"{path}: a recipe is a YAML mapping of sections, got {type(data).__name__}"
        )
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML, so 3 -> int, 1.0e-3 -> float, [a, b] -> list)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise InputError("--set", item, "use --set section.key=value, e.g. --set train.max_steps=400")
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        value = text
    return key, value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            path = ".".join(parts[: depth + 1])
            raise InputError(key, value, f"{path} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise _first_error(e, raw) from None


def resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    """Make data, model and checkpoint paths absolute so the job reads them from any directory."""
    update: dict[str, Any] = {"data": recipe.data.model_copy(update={"path": _abs(recipe.data.path, base)})}
    if recipe.model.path:
        update["model"] = recipe.model.model_copy(update={"path": _abs(recipe.model.path, base)})
    if recipe.checkpoint.dir:
        update["checkpoint"] = recipe.checkpoint.model_copy(update={"dir": _abs(recipe.checkpoint.dir, base)})
    return recipe.model_copy(update=update)


def _abs(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _first_error(e: ValidationError, raw: dict[str, Any]) -> InputError:
    errors = e.errors(include_url=False)
    err = errors[0]
    loc = tuple(str(part) for part in err["loc"])
    field = ".".join(loc) or "recipe"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    ctx = err.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, CrossFieldError):
        return InputError(cause.field, cause.value, cause.allowed + more)
    if err["type"] == "extra_forbidden":
        return InputError(field, err.get("input"), message=_unknown_key(loc) + more)
    if err["type"] == "missing":
        return InputError(field, message=f"{field}: required field is missing{more}")
    msg = err["msg"].removeprefix("Value error, ")
    return InputError(field, err.get("input"), _lower_first(msg) + more)


def _unknown_key(loc: tuple[str, ...]) -> str:
    """'train.lrr: unknown key; did you mean train.lr?' with the valid keys of that section."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        ann = getattr(field, "annotation", None)
        model = next(
            (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
    valid = sorted(model.model_fields) if model else []
    prefix = ".".join(loc[:-1])
    name = ".".join(loc)
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
    hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
    section = f"{prefix}: " if prefix else ""
    return f"{name}: unknown key{hint} ({section}valid keys are {', '.join(valid)})"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text else text
