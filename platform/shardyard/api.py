"""shardyard from Python, for code that lives in Python rather than YAML: the job spec as an
object, your model, dataset and loss as functions, and `fit`, which trains it on Ray exactly as
`shardyard train` does (the same run directory, resumption and refusals).

    from shardyard.api import fit, job
    from my_task import build_model, build_dataset, loss

    spec = job("jobs/configs/vision_ddp.yaml", ["scaling.num_workers=4"])
    result = fit(spec, model=build_model, data=build_dataset, loss=loss)
    print(result.checkpoint)

`fit` trains on the cluster RAY_ADDRESS names, or the one this process is connected to (a
notebook on a cluster's node after `ray.init(address="auto")`), or the one running on this
machine, else on a local Ray it starts. Workers import your functions by name, so each must live in a module they can import
(the directory you run in, an installed package, or Ray's runtime environment: `working_dir`,
`py_modules`), not in `__main__` or a notebook cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardyard.spec import JobSpec, SpecError, load_spec, parse_spec
from shardyard.train.metrics import RunResult


def job(config: str | Path | dict[str, Any] | None = None, overrides: Sequence[str] = ()) -> JobSpec:
    """A job spec, validated: from a YAML file (its `base:` files merged) or a dict holding what
    the YAML would, where a section's `factory` may be the function itself, with `--set`-style
    overrides ("optim.lr=3e-4"). Raises SpecError naming each bad key, before anything starts."""
    return load_spec(_named_factories(config) if isinstance(config, dict) else config, list(overrides))


def _named_factories(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with each section's callable `factory` replaced by the name workers import it by."""
    return {key: {**section, "factory": reference(section["factory"], f"{key}.factory")}
            if isinstance(section, dict) and callable(section.get("factory")) else section
            for key, section in raw.items()}


Function = Callable[..., Any]


def fit(spec: JobSpec, *, model: Function | None = None, data: Function | None = None, loss: Function | None = None,
        metrics: Function | None = None, take_over: bool = False) -> RunResult:
    """Train `spec` to run.steps on Ray, resuming the run's newest good checkpoint, and return the
    run's directory, last checkpoint and summary. `model`, `data`, `loss` and `metrics` replace
    the spec's model.factory, data.factory, loss.factory and metrics.factory (a task of your own:
    model.name 'module'). Raises SpecError (the spec or a function cannot run),
    train.job.NothingToTrain (the run is already at run.steps), and the outcomes `shardyard
    train` exits with (train/outcomes.py)."""
    from shardyard.train.job import train_job  # imports Ray only when training

    return train_job(with_functions(spec, model, data, loss, metrics), attach_to_running=True, take_over=take_over)


def with_functions(spec: JobSpec, model: Function | None, data: Function | None, loss: Function | None,
                   metrics: Function | None = None) -> JobSpec:
    """`spec` with the factories these functions name (validated again: each is imported)."""
    raw = spec.model_dump(mode="json")
    if model is not None:
        raw["model"] = {"name": "module", "options": {}, **_without_kind(raw["model"]), "factory": reference(model, "model")}
    if data is not None:
        raw["data"] = {**raw["data"], "name": "factory", "factory": reference(data, "data")}
    for key, function in (("loss", loss), ("metrics", metrics)):
        if function is not None:
            raw[key] = {"options": {}, **(raw.get(key) or {}), "factory": reference(function, key)}
    return parse_spec(raw)


def _without_kind(model: dict[str, Any]) -> dict[str, Any]:
    """A module section keeps its options; another kind of model's keys do not apply to one."""
    return {"options": model.get("options", {})} if model.get("name") == "module" else {}


def reference(function: Callable[..., Any], what: str) -> str:
    """'package.module:function' for a function (or class) workers can import by that name."""
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if module in (None, "__main__") or "." in name or not name.isidentifier():
        where = "a notebook cell or the script run as __main__" if module == "__main__" else f"{module}, not at its top level"
        raise SpecError(f"{what}: {getattr(function, '__name__', function)!r} is defined in {where}: Ray's workers "
                        f"import functions by name, so define it at the top level of a module of yours (a .py file "
                        f"in the directory you run in, or a package) and import it from there")
    return f"{module}:{name}"
