"""Where Ray Train workers go (train/worker_resources.py): a local Ray instance, which cannot
grow, never waits for GPUs it will not get; a cluster that can grow is waited for."""

from __future__ import annotations

import logging

import pytest

from shardyard.spec import SpecError, load_spec
from shardyard.train.ray_train.worker_resources import place_workers
from helpers.repo import REPO

pytestmark = pytest.mark.timeout(30)

DEFAULT_JOB = REPO / "jobs/configs/gpt_ddp.yaml"  # two workers


def test_readme_default_job_on_one_gpu_trains_on_cpu_and_says_how_to_use_the_gpu() -> None:
    placed = place_workers(load_spec(DEFAULT_JOB), {"CPU": 16.0, "GPU": 1.0}, can_grow=False)
    assert not placed.use_gpu and "GPU" not in placed.resources
    assert "1 GPU cannot hold 2 workers" in placed.reason and "--set scaling.num_workers=1" in placed.reason


def test_gpus_that_hold_the_group_train_it_and_a_cpu_machine_trains_on_cpu() -> None:
    placed = place_workers(load_spec(DEFAULT_JOB), {"CPU": 16.0, "GPU": 2.0}, can_grow=False)
    assert placed.use_gpu and placed.resources == {"CPU": 1.0, "GPU": 1.0} and placed.reason == ""
    placed = place_workers(load_spec(DEFAULT_JOB), {"CPU": 2.0}, can_grow=False)
    assert not placed.use_gpu and placed.reason == ""


def test_an_elastic_run_on_one_gpu_is_told_its_min_workers() -> None:
    spec = load_spec(DEFAULT_JOB, ["scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=3",
                                       "batch.global_batch_size=48"])
    placed = place_workers(spec, {"CPU": 16.0, "GPU": 1.0}, can_grow=False)
    assert not placed.use_gpu and "--set scaling.min_workers=1" in placed.reason
    assert place_workers(spec, {"CPU": 16.0, "GPU": 2.0}, can_grow=False).use_gpu  # 2 of the 3 fit


def test_asking_for_gpus_a_local_instance_lacks_stops_at_once_naming_the_setting() -> None:
    with pytest.raises(SpecError, match=r"1 GPU cannot hold 2 workers .*--set scaling.num_workers=1"):
        place_workers(load_spec(DEFAULT_JOB, ["scaling.use_gpu=true"]), {"CPU": 16.0, "GPU": 1.0}, can_grow=False)
    with pytest.raises(SpecError, match="has none; set scaling.use_gpu=auto"):
        place_workers(load_spec(DEFAULT_JOB, ["scaling.use_gpu=true"]), {"CPU": 16.0}, can_grow=False)
    with pytest.raises(SpecError, match=r"cannot hold 2 workers \(CPU: need 16, cluster has 2\)"):
        place_workers(load_spec(DEFAULT_JOB, ["scaling.resources_per_worker.CPU=8"]), {"CPU": 2.0}, can_grow=False)


def test_a_cluster_that_can_grow_is_waited_for_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shardyard"):
        placed = place_workers(load_spec(DEFAULT_JOB), {"CPU": 16.0, "GPU": 1.0}, can_grow=True)
    assert placed.use_gpu and placed.resources["GPU"] == 1.0
    assert "cannot yet hold 2 workers (GPU: need 2, cluster has 1); waiting for it to scale up" in caplog.text


def test_float8_on_workers_placed_on_cpu_stops_at_once() -> None:
    float8 = load_spec(DEFAULT_JOB, ["run.precision=float8"])
    with pytest.raises(SpecError, match="run.precision float8 trains on GPUs .* workers run on CPU: use run.precision auto"):
        place_workers(float8, {"CPU": 16.0}, can_grow=False)
    assert place_workers(float8, {"CPU": 16.0, "GPU": 2.0}, can_grow=False).use_gpu
