"""Reading a spec: a YAML file, the files it extends (`base:`), and `--set key.path=value`
overrides, as one mapping for validation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from shardyard.spec.base import SpecError


def read_yaml(path: str | Path | dict[str, Any] | None, overrides: list[str] | tuple[str, ...],
              what: str) -> dict[str, Any]:
    """A YAML spec file as a mapping (empty without a file; a mapping given instead of a file, as
    the Python API takes one, copied), with `key.path=value` overrides applied. A file may extend
    another (`base: other.yaml`, relative to the file): its keys are merged into the base's,
    section by section, and the overrides come last."""
    if isinstance(path, dict):
        raw = copy.deepcopy(path)
    else:
        raw = _read_file(Path(path), what, ()) if path is not None else {}
    for item in overrides:
        apply_override(raw, item)
    return raw


def _read_file(path: Path, what: str, extending: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise SpecError(f"{what} {str(path)!r} does not exist"
                        + (f" (the base of {str(extending[-1])!r})" if extending else ""))
    try:
        with path.open() as stream:  # from the file, so that YAML's message names it, not "<unicode string>"
            raw = yaml.safe_load(stream) or {}
    except yaml.YAMLError as err:
        raise SpecError(f"{what} {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{what} {str(path)!r} must be a mapping of sections, not {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise SpecError(f"{what} {str(path)!r}: base must be the path of another YAML file")
    base_path = (path.parent / base).resolve()
    if base_path in (*extending, path.resolve()):
        raise SpecError(f"{what} {str(path)!r}: base {base!r} extends itself through "
                        + " -> ".join(str(p) for p in (*extending, path)))
    return _merged(_read_file(base_path, what, (*extending, path.resolve())), raw)


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: sections merged key by key, anything else replaced, and a section that
    names another kind (`model: {name: hf}` over a GPT) replaced whole."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        same_kind = isinstance(below, dict) and isinstance(value, dict) and value.get("name", below.get("name")) == below.get("name")
        out[key] = _merged(below, value) if same_kind else value
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as YAML (3e-4, true, [1, 2])."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"override {item!r} must look like section.key=value")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError:
        node[parts[-1]] = text
