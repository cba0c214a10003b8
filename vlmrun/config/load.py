"""Load a recipe: YAML file -> dotted `--set` overrides -> validated `Recipe`.

Every failure is an `InputError` that names the field path, the bad value and what is allowed, so
the CLI can print it in one or two lines and exit 2.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vlmrun.config.recipe import CrossFieldError, Recipe
from vlmrun.errors import InputError, short_repr

# A recipe is a few KiB and a few hundred values; these bounds are far above any real one.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 32


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus YAML 1.2's exponent floats: YAML 1.1 reads `3e-4` (no dot) as a string,
    and a nesting bound while composing: PyYAML's scanner costs more the deeper a flow collection is
    open, so `[[[[...` 20000 deep took over a second to reach Python's recursion limit; it stops at
    MAX_YAML_DEPTH now (aliases, which nest deeper once expanded, are measured after, `_measure`)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Unbounded(f"nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_recipe(path: str | Path, overrides: list[str] = (), *, base_dir: Path | None = None) -> Recipe:
    """Read, override and validate a recipe; relative paths in it resolve against `base_dir` (cwd)."""
    raw = read_yaml(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    recipe = validate(raw)
    return resolve_paths(recipe, base_dir or Path.cwd())


def read_yaml(path: str | Path, *, field: str = "RECIPE") -> dict[str, Any]:
    """The YAML mapping in the file at `path`; InputError on `field`, naming the file, when it is not one.

    Bounded (MAX_YAML_BYTES, and parse_yaml's limits), so a hostile file fails fast instead of hanging.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(field, str(path), message=f"recipe file not found: {path}")
    try:
        if p.stat().st_size > MAX_YAML_BYTES:
            raise InputError(field, str(path), message=f"{path}: larger than {MAX_YAML_BYTES >> 10} KiB; not a recipe")
        text = p.read_bytes().decode()
    except UnicodeDecodeError:
        raise InputError(field, str(path), message=f"{path}: not a text (UTF-8) file") from None
    except OSError as e:
        raise InputError(field, str(path), message=f"{path}: cannot read it: {e.strerror or e}") from None
    data = parse_yaml(text, str(path), field=field)
    if not isinstance(data, dict):
        raise InputError(
            field, str(path), message=f"{path}: a recipe is a YAML mapping of sections, got {type(data).__name__}"
        )
    return data


def parse_yaml(text: str, source: str, *, field: str = "RECIPE") -> Any:
    """YAML `text` -> Python data; InputError on `field`, naming `source`, for text that is not YAML
    or that is unbounded (`_load_bounded`)."""
    try:
        return _load_bounded(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(field, source, message=f"{source}{where}: malformed YAML: {problem}") from None
    except _Unbounded as e:
        raise InputError(field, source, message=f"{source}: {e}") from None


def _load_bounded(text: str) -> Any:
    """yaml.safe_load with bounds: aliases are counted every time they are used, so a document that
    would expand past MAX_YAML_VALUES values or nest deeper than MAX_YAML_DEPTH (a "billion laughs"
    bomb) is refused before it is built. Raises yaml.YAMLError or _Unbounded."""
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, 1, {}, set())
        return loader.construct_document(node)
    except RecursionError:
        raise _Unbounded(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
    except ValueError as e:  # a value YAML recognised but Python cannot build: a 5000-digit int, month 13
        raise _Unbounded(f"a value cannot be built: {short_repr(str(e), quote=False)}") from None
    finally:
        loader.dispose()


class _Unbounded(Exception):
    """A YAML document too large once its aliases are expanded, too deep, or containing itself."""


def _measure(node: yaml.Node, depth: int, memo: dict[int, tuple[int, int]], open_: set[int]) -> tuple[int, int]:
    """(values, levels) of `node` with every alias expanded; memoised, so linear in the document's size."""
    key = id(node)
    if key in memo:
        size, height = memo[key]
    else:
        if key in open_:
            raise _Unbounded("an alias refers to a collection that contains it")
        if depth > MAX_YAML_DEPTH:
            raise _Unbounded(f"nested deeper than {MAX_YAML_DEPTH} levels")
        open_.add(key)
        size, height = 1, 1
        for child in _children(node):
            child_size, child_height = _measure(child, depth + 1, memo, open_)
            size, height = size + child_size, max(height, child_height + 1)
            if size > MAX_YAML_VALUES:
                raise _Unbounded(f"expands to more than {MAX_YAML_VALUES} values (aliases of aliases?); not a recipe")
        open_.discard(key)
        memo[key] = size, height
    if depth + height - 1 > MAX_YAML_DEPTH:
        raise _Unbounded(f"nested deeper than {MAX_YAML_DEPTH} levels")
    return size, height


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML, so 3 -> int, 1e-3 -> float, [a, b] -> list).

    Text that is not YAML stays text; YAML that is unbounded (`_load_bounded`) is an InputError.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise InputError("--set", item, "use --set section.key=value, e.g. --set train.max_steps=400")
    if not text.strip():
        return key, text
    try:
        return key, _load_bounded(text)
    except yaml.YAMLError:
        return key, text  # not YAML: the value is the text, and the field's own check says what it expects
    except _Unbounded as e:
        raise InputError(key, message=f"--set {key}: {e}") from None


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` (a.b.c) in `raw` to `value`; a mapping given for a mapping is merged into it key by key.

    So `--set train={max_steps: 5}` changes train.max_steps and keeps the rest of the recipe's train
    section: a section given whole never resets the keys it leaves out to their defaults. Mappings on
    the way are copied, never changed in place (YAML aliases may share them with other sections).
    """
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            path = ".".join(parts[: depth + 1])
            raise InputError(key, value, f"{path} is a value, not a section")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = _merged(node.get(parts[-1]), value)


def _merged(old: Any, new: Any) -> Any:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out = dict(old)
    for key, value in new.items():
        out[key] = _merged(out.get(key), value)
    return out


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
    loc = tuple(short_repr(part, 40, quote=False) for part in err["loc"])
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
