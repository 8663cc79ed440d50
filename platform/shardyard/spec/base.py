"""What every spec (the job's, the serving app's, the pool's, `shardyard prepare`'s) is made of:
strict sections, and validation whose errors name the key the user wrote, with the closest valid
choice."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo


class SpecError(ValueError):
    """A job spec that cannot run. The message is meant for the user, not a traceback."""


class Section(BaseModel):
    # extra="forbid" is what turns a misspelled key into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


STORED = {"stored": True}  # validation context of a spec read from a checkpoint


def read_from_storage(info: ValidationInfo) -> bool:
    """Whether the spec being validated was read from a checkpoint (not launched by the user)."""
    return bool(info.context and info.context.get("stored"))


Model = typing.TypeVar("Model", bound=BaseModel)


def validate(cls: type[Model], raw: dict[str, Any], title: str) -> Model:
    """`cls` from `raw`, or a SpecError whose message names each bad key (see explain_errors)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise SpecError(explain_errors(err, cls, title)) from None


def explain_errors(err: ValidationError, root: type[BaseModel], title: str) -> str:
    """One line per error, naming the dotted key (and the valid keys where one is unknown)."""
    lines = []
    for e in err.errors():
        where, cls = _walk(e["loc"], root)
        if e["type"] == "extra_forbidden":
            valid = sorted(cls.model_fields) if cls else []
            hint = did_you_mean(str(e["loc"][-1]), valid)
            lines.append(f"unknown key {where!r}{f' ({hint})' if hint else ''}; valid keys here: "
                         f"{', '.join(valid) or '?'}")
        elif e["type"] in ("literal_error", "union_tag_invalid"):  # a choice: the closest one named
            got = e.get("input") if e["type"] == "literal_error" else e["ctx"].get("tag")
            choices = re.findall(r"'([^']*)'", str(e["ctx"].get("expected", e["ctx"].get("expected_tags", ""))))
            hint = did_you_mean(str(got), choices)
            lines.append(f"{where or 'spec'}: {e['msg']} (got {got!r}{f'; {hint}' if hint else ''})")
        elif e["type"] == "value_error":  # a section's own check names its keys; a field's does not
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if "." in where else msg)
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
            lines.append(f"{where or 'spec'}: {e['msg']}{shown}")
    return f"{title}:\n  - " + "\n  - ".join(lines)


def did_you_mean(word: str, choices: list[str]) -> str:
    """"did you mean 'x'?" for the closest of `choices` to a misspelled `word`, or ""."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def _walk(loc: tuple, root: type[BaseModel]) -> tuple[str, type[BaseModel] | None]:
    """Turn pydantic's error location into a dotted key, and find the section class at its parent.

    Discriminated unions put the tag in the location (`model.gpt.n_layr`); it is dropped here so
    the message uses the key the user wrote (`model.n_layr`).
    """
    cls: Any = root
    names: list[str] = []
    parent: type[BaseModel] | None = None
    pending_union = False
    for part in loc:
        if pending_union:
            cls = next((m for m in members(cls) if m.model_fields["name"].default == part), None)
            pending_union = False
            continue
        names.append(str(part))
        parent = cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        field = parent.model_fields.get(str(part)) if parent else None
        cls = field.annotation if field else None
        pending_union = len(members(cls)) > 1
    return ".".join(names), parent


def members(annotation: Any) -> list[type[BaseModel]]:
    """The sections a field may hold: one, or each member of a tagged union."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []
