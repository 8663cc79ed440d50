"""The Python API's spec side: `job` from a file or a dict, and the functions `fit` is given turned
into the factories workers import, or refused with what to do. (`fit` itself trains in the quick
start's own-task journey, continuing a run `shardyard train` began.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardyard.api import job, with_functions
from shardyard.spec import SpecError
from helpers.repo import REPO
from jobs.vision import SyntheticImages, accuracy, cross_entropy, small_cnn


def test_a_job_from_a_file_or_a_dict_is_validated_with_its_overrides() -> None:
    from_file = job(REPO / "jobs" / "configs" / "vision_ddp.yaml", ["scaling.num_workers=4"])
    assert from_file.scaling.num_workers == 4 and from_file.model.factory == "jobs.vision:small_cnn"
    from_dict = job({"run": {"name": "mine"}, "checkpoint": {"storage_path": "runs"}}, ["run.steps=7"])
    assert (from_dict.run.name, from_dict.run.steps) == ("mine", 7)
    assert Path(from_dict.checkpoint.storage_path).is_absolute()  # as `shardyard train` makes it
    with pytest.raises(SpecError, match="unknown key 'run.stepz'"):
        job({"run": {"stepz": 3}})


def test_a_dicts_factories_may_be_the_functions_themselves() -> None:
    spec = job({"model": {"name": "module", "factory": small_cnn, "options": {"channels": 4}},
                "data": {"name": "factory", "factory": SyntheticImages}, "loss": {"factory": cross_entropy}})
    assert (spec.model.factory, spec.model.options) == ("jobs.vision:small_cnn", {"channels": 4})
    assert (spec.data.factory, spec.loss.factory) == ("jobs.vision:SyntheticImages", "jobs.vision:cross_entropy")
    with pytest.raises(SpecError, match="data.factory: 'inner' is defined in .*test_api, not at its top level"):
        job({"data": {"name": "factory", "factory": make_inner()}})


def test_functions_become_the_factories_workers_import() -> None:
    spec = with_functions(job({"model": {"name": "gpt"}}), small_cnn, SyntheticImages, cross_entropy)
    assert (spec.model.name, spec.model.factory) == ("module", "jobs.vision:small_cnn")
    assert (spec.data.name, spec.data.factory, spec.loss.factory) == (
        "factory", "jobs.vision:SyntheticImages", "jobs.vision:cross_entropy")
    kept = with_functions(job(REPO / "jobs" / "configs" / "vision_ddp.yaml"), small_cnn, None, None, accuracy)
    assert kept.model.options == {"channels": 16, "classes": 10, "size": 16}  # a module's options stay
    assert kept.metrics.factory == "jobs.vision:accuracy" and kept.data.validation_options is not None


def make_inner():
    def inner() -> None: ...
    return inner


@pytest.mark.parametrize(("function", "says"), [
    (lambda: None, "is defined in a notebook cell or the script run as __main__"),
    (make_inner(), "not at its top level"),
])
def test_a_function_workers_cannot_import_is_refused_before_anything_starts(function, says: str) -> None:
    if says.startswith("is defined in a notebook"):
        function.__module__ = "__main__"  # as in a notebook cell
    with pytest.raises(SpecError, match=says):
        with_functions(job(REPO / "jobs" / "configs" / "vision_ddp.yaml"), function, None, None)
