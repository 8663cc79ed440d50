"""The configuration reference (docs/reference.md), written from the spec's own fields: their
names, types, defaults and descriptions, so that the documentation cannot drift from what the
validator accepts (tests/test_docs.py checks the committed page is current).

    python -m shardyard.docs            # rewrites docs/reference.md
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shardyard.pool.spec import LendWhen, Policy, PoolSpec
from shardyard.serve.config import VLLM_NAMES, CanarySettings, ServeConfig
from shardyard.spec import JobSpec, members

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML terms."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return (getattr(annotation, "__name__", None) or str(annotation)).replace("typing.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    return "null" if value is None else f"`{value}`"


def _rows(cls: type[BaseModel], prefix: str, sections: bool = True) -> list[str]:
    """A row per key of `cls`; `sections=False`: not those that are sections (tables of their own)."""
    rows = []
    for name, field in cls.model_fields.items():
        if name == "name" and prefix.startswith("model."):
            continue  # the union's tag: named in the section's heading
        if not sections and name != "canary" and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | {description} |")
    return rows


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: its class, or the class of an optional one (`X | None`)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _table(rows: list[str]) -> str:
    return "| key | type | default | meaning |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"


def reference() -> str:
    out = ["# Reference\n",
           "Every key the job spec and the serving config accept, written from their definitions "
           "(`python -m shardyard.docs`). [The job spec](job-spec.md) explains them by topic.\n",
           "## Job spec\n"]
    for section, field in JobSpec.model_fields.items():
        kinds = members(field.annotation)
        if len(kinds) > 1:  # model: one table per kind of model
            for member in kinds:
                kind = member.model_fields["name"].default
                out.append(f"### `{section}` with `name: {kind}`\n")
                out.append(_table(_rows(member, f"{section}.")))
        elif (cls := _section_class(field.annotation)) is not None:
            out.append(f"### `{section}`{' (optional)' if field.default is None else ''}\n")
            out.append(_table(_rows(cls, f"{section}.")))
    out.append("## Serving config\n")
    out.append("The arguments of `serve_apps.gpt:app` (a Serve config file's `args:`, each section nested; "
               "`serve run ... section.key=value`) and of `shardyard serve` (`--set section.key=value`). "
               "`engine`, `batching` and `follow` also take one word for the setting they are mostly about "
               "(`engine: vllm`, `batching: fixed`, `follow: false`). vLLM's names are accepted for the same "
               "settings: " + ", ".join(f"`{theirs}` for `{ours}`" for theirs, ours in VLLM_NAMES.items())
               + ", and `tensor_parallel_size` or `pipeline_parallel_size` for `engine.num_shards` with "
               "`engine.sharding`.\n")
    out.append(_table(_rows(ServeConfig, "", sections=False)))
    for name, section in [(n, f.annotation) for n, f in ServeConfig.model_fields.items()
                          if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]:
        out.append(f"### `{name}`\n")
        out.append(_table(_rows(section, f"{name}.", sections=False)))
        if name == "follow":
            out.append("### `follow.canary`\n")
            out.append(_table(_rows(CanarySettings, "follow.canary.")))
    out.append("## Pool spec\n")
    out.append("The file `shardyard pool` reads ([the elastic pool](pool.md)).\n")
    sections = [(name, field.annotation) for name, field in PoolSpec.model_fields.items()]
    sections.insert(sections.index(("policy", Policy)) + 1, ("policy.lend_when", LendWhen))
    for section, cls in sections:
        out.append(f"### `{section}`\n")
        out.append(_table(_rows(cls, f"{section}.")))
    return "\n".join(out)


if __name__ == "__main__":
    PAGE.write_text(reference())
    print(PAGE)
