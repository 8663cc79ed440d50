"""The pool spec (`shardyard pool POOL.yaml`): which devices are pooled, the training run and the
serving app that share them, and the policy that moves devices between the two.

Validated whole before anything starts: the pool's own keys strictly, the training job as
`shardyard train` validates it, the serving app's keys by name (its checkpoint may not exist
until training commits one, so the app itself is built, and checked again, from that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from shardyard.serve.config import ServeConfig
from shardyard.spec import JobSpec, Section, SpecError, load_spec, read_yaml, validate

SIGNALS = ("queue_length", "ttft_p90_ms", "kv_occupancy")


class Devices(Section):
    resource: str = Field("GPU", min_length=1, description="the Ray resource one device is: GPU on a GPU "
                          "cluster, or a custom resource the nodes carry (one unit a device)")
    units: int | None = Field(None, ge=2, description="devices in the pool: a local Ray instance started for "
                              "the pool gets this many of a custom resource; on a cluster (RAY_ADDRESS) the "
                              "nodes carry them and this is left out")

    @model_validator(mode="after")
    def _check(self) -> Devices:
        if self.resource in ("CPU", "memory", "object_store_memory"):
            raise ValueError(f"pool.resource {self.resource!r}: a pooled device is a GPU or a custom resource, "
                             "not one every process takes a share of")
        return self


class Training(Section):
    job: str = Field(description="the job spec of the elastic run (scaling.min_workers .. max_workers)")
    set: list[str] = Field(default_factory=list, description="overrides of the job spec, key=value")


class Serving(Section):
    app: str = Field("shardyard", min_length=1, description="the Serve application's name")
    host: str = Field("127.0.0.1", description="where Serve's HTTP proxy listens")
    port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP port")
    args: dict[str, Any] = Field(default_factory=dict, description="the serving app's keys (serve_apps/config.yaml's "
                                 "args); checkpoint is the run's directory, max_replicas is required")


class LendWhen(Section):
    signal: Literal["queue_length", "ttft_p90_ms", "kv_occupancy"] = Field(
        "ttft_p90_ms", description="queue_length: requests at a replica (decoding or waiting), averaged over "
        "replicas; ttft_p90_ms: time to first token from a request's arrival at its replica (its wait for admission "
        "included), 90th percentile over the last `for_s`; kv_occupancy: "
        "the share of KV cache blocks held")
    above: float = Field(gt=0, description="the SLO: the signal over this is a breach")
    for_s: float = Field(10.0, ge=0, description="a breach this long (and Serve wanting a replica it cannot "
                         "place) lends a device")


class Policy(Section):
    priority: Literal["serving", "training"] = Field(
        "serving", description="serving: training lends devices down to its min_workers when the SLO is "
        "breached; training: the run never shrinks for serving, which scales only into devices left free")
    lend_when: LendWhen = Field(description="the SLO whose breach lends a device (keys below)")
    cool_down_s: float = Field(60.0, ge=0, description="a device goes back to training only after the SLO held "
                               "this long, since the last breach and the last lend, and Serve let the replica go")
    poll_interval_s: float = Field(1.0, gt=0, description="how often the arbiter looks")
    resize_cost_s: float = Field(20.0, ge=0, description="what one resize costs training (a worker group's "
                                 "restart): a lend waits for a breach at least this long, so a burst shorter "
                                 "than a resize never moves a device")
    min_dwell_s: float = Field(60.0, ge=0, description="after a lend or a return, the run stays at its size at "
                               "least this long")
    max_lends_per_hour: int = Field(6, ge=1, description="the budget: at most this many lends in any hour (each "
                                    "costs two resizes); and each lend in the last hour doubles the breach the "
                                    "next one waits for")


class PoolSpec(Section):
    pool: Devices = Field(default_factory=Devices)
    training: Training
    serving: Serving = Field(default_factory=Serving)
    policy: Policy


def check_training(job: JobSpec) -> None:
    """The run can be lent from: elastic, in a Ray Train group, restarted from checkpoints."""
    s, strategy = job.scaling, job.parallelism.strategy
    if s.num_workers is not None:
        raise SpecError("training.job: the pool lends an elastic run's workers: set scaling.min_workers and "
                        f"scaling.max_workers (not scaling.num_workers={s.num_workers})")
    if strategy == "parameter_server":
        raise SpecError("training.job: parallelism.strategy 'parameter_server' runs its own actors, not a worker "
                        "group the pool can resize")
    if s.recovery == "hot":
        raise SpecError("training.job: scaling.recovery 'hot' keeps survivors training through a failure; the pool "
                        "resizes by checkpoint and restart: use scaling.recovery restart")
    if not job.checkpoint.every_n_steps:
        raise SpecError("training.job: serving loads the run's checkpoints: set checkpoint.every_n_steps")


def with_devices(job: JobSpec, devices: Devices) -> JobSpec:
    """Each worker holds one device of the pool (a GPU through Ray Train's use_gpu, or one unit of
    the custom resource)."""
    job = job.model_copy(deep=True)
    if devices.resource == "GPU":
        if job.scaling.use_gpu is False:
            raise SpecError("training.job: pool.resource is GPU and scaling.use_gpu is false")
        job.scaling.use_gpu = True
    else:
        job.scaling.resources_per_worker = {**job.scaling.resources_per_worker, devices.resource: 1.0}
    return job


def serving_args(pool: PoolSpec, job: JobSpec) -> dict[str, Any]:
    """The app's arguments: the run's directory, followed; each replica holding one device."""
    config = check_serving(pool.serving.args)
    run_dir = str(Path(job.checkpoint.storage_path) / job.run.name)
    if "checkpoint" in config.model_fields_set and Path(config.checkpoint).expanduser().resolve() != Path(run_dir).resolve():
        raise SpecError(f"serving.args.checkpoint: the pool serves its own run ({run_dir}); leave checkpoint out")
    if config.autoscaling is None or "max_replicas" not in config.autoscaling:
        raise SpecError("serving.args.autoscaling.max_replicas: the pool lends devices to an autoscaling app: set "
                        "autoscaling.max_replicas above autoscaling.min_replicas")
    if config.engine.num_shards != 1:
        raise SpecError("serving.args.engine.num_shards: a pooled replica decodes on one device (a worker lent is "
                        "one device); sharded replicas are not lent to")
    engine = config.engine
    if pool.pool.resource != "GPU":
        engine = engine.model_copy(update={"device_resources": {pool.pool.resource: 1.0}})
    return config.model_copy(update={"checkpoint": run_dir, "engine": engine,
                                     "follow": config.follow.model_copy(update={"enabled": True})}).arguments()


def check_serving(args: dict[str, Any]) -> ServeConfig:
    """Every key and value of the app checked now; what they name (the model, its tokenizer) is
    read when the pool deploys the app, once training has committed a checkpoint."""
    return validate(ServeConfig, args, "invalid serving.args")


def replica_bounds(args: dict[str, Any]) -> tuple[int, int]:
    """The fewest and most replicas of the pool's app (its checked arguments)."""
    scaling = args["autoscaling"]
    return scaling.get("min_replicas", 1), scaling["max_replicas"]


def load_pool(path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[PoolSpec, JobSpec]:
    """The pool spec and its training job (job path relative to the pool file), validated."""
    pool = validate(PoolSpec, read_yaml(path, overrides, "pool spec"), "invalid pool spec")
    job_path = Path(path).parent / pool.training.job
    job = with_devices(load_spec(job_path if job_path.is_file() else pool.training.job, pool.training.set), pool.pool)
    check_training(job)
    args = serving_args(pool, job)
    replicas, most = replica_bounds(args)
    if most <= replicas:
        raise SpecError(f"serving.args.autoscaling.max_replicas ({most}) must be above min_replicas ({replicas}): "
                        "else serving never asks for a device")
    units = pool.pool.units
    if units is not None and units < job.scaling.min_workers + replicas:
        raise SpecError(f"pool.units ({units}) cannot hold training's min_workers ({job.scaling.min_workers}) and "
                        f"serving's autoscaling.min_replicas ({replicas})")
    pool.serving.args = args
    return pool, job
