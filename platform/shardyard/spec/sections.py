"""The job spec's sections apart from the model: data, optimizer, batch, parallelism, scaling,
checkpoints, evaluation and the run itself, each with the rules that concern it alone."""

from __future__ import annotations

import importlib.util
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shardyard.spec.base import Section, read_from_storage
from shardyard.spec.factories import check_factory
from shardyard.storage.store import local_path_of


class DataSpec(Section):
    name: Literal["corpus", "synthetic", "shards", "factory"] = Field(
        "corpus", description="corpus: byte-level text read into memory; shards: what `shardyard prepare` wrote; "
        "synthetic: random regression data (the MLP); factory: a dataset of the user's own (data.factory)")
    path: str | None = Field(
        None, description="text file or folder for `corpus` (default: the Python stdlib sources); the "
                          "directory `shardyard prepare` wrote for `shards` (local or object storage)"
    )
    max_bytes: int = Field(4_000_000, ge=1024, description="cap on corpus size read into memory")
    num_samples: int = Field(4096, ge=1, description="size of the `synthetic` dataset")
    validation_path: str | None = Field(
        None, description="`shards`: another prepared directory to validate on (default: data.path's validation split)"
    )
    cache_dir: str | None = Field(None, description="`shards` in object storage: local download folder")
    cache_bytes: int = Field(2 << 30, ge=1 << 20, description="`shards` in object storage: local cache cap per rank")
    factory: str | None = Field(
        None, description="`factory`: 'package.module:function', called with data.options, returning a map-style "
        "dataset (len() and [i]) or an iterable one (read in its order, again from its start when it ends), any "
        "sample type, the same on every worker (make it from a seed)")
    options: dict[str, Any] = Field(default_factory=dict, description="`factory`: keyword arguments of data.factory")
    collate: str | None = Field(
        None, description="`factory`: 'package.module:function' making a batch of a list of samples (default: "
        "torch's default_collate, which stacks tensors and numbers and keeps tuples and dicts)")
    validation_options: dict[str, Any] | None = Field(
        None, description="`factory`: the validation split, data.factory called with these over data.options "
        "({split: val}, a held-out path); eval.every_n_steps validates on it")

    @model_validator(mode="after")
    def _shards_have_a_path(self, info: ValidationInfo) -> DataSpec:
        if self.name == "shards" and not self.path:
            raise ValueError("data.name 'shards' needs data.path: the directory `shardyard prepare` wrote")
        if (self.name == "factory") != (self.factory is not None):
            raise ValueError("data.factory names the dataset of data.name 'factory', and only of it")
        for key in ("collate", "validation_options"):
            if getattr(self, key) is not None and self.name != "factory":
                raise ValueError(f"data.{key} applies to data.name 'factory' only")
        if not read_from_storage(info):
            for key, reference in (("data.factory", self.factory), ("data.collate", self.collate)):
                if reference is not None:
                    check_factory(key, reference)
        return self


class FunctionSection(Section):
    """A section naming a function of the user's: `factory`, called with `options`, imported when the
    spec is validated to check it (never for a spec read from a run directory, which names code)."""

    key: ClassVar[str]
    factory: str
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments the factory is called with")

    @model_validator(mode="after")
    def _factory_exists(self, info: ValidationInfo) -> FunctionSection:
        if not read_from_storage(info):
            check_factory(f"{self.key}.factory", self.factory)
        return self


class LossSpec(FunctionSection):
    key: ClassVar[str] = "loss"
    factory: str = Field(description="'package.module:function', called with loss.options, returning the loss: "
                         "a function of the model's output and the batch giving a scalar tensor, the mean over "
                         "the batch's samples (micro-batches are averaged as equal shares of the global batch)")


class MetricsSpec(FunctionSection):
    key: ClassVar[str] = "metrics"
    factory: str = Field(description="'package.module:function', called with metrics.options, returning a "
                         "function of the model's output and a validation batch giving {name: scalar}, each the "
                         "mean over the batch's samples; logged as val_<name> beside val_loss")


class OptimSpec(Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="the optimizer (SGD without momentum works under every strategy)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="on linear layers' matrices only, not biases, norms or embeddings")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's moment decay rates")
    momentum: float = Field(0.0, ge=0, description="for sgd")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 to lr over this many steps")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="after warmup: cosine decay to lr x min_lr_ratio, or constant")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")


class BatchSpec(Section):
    global_batch_size: int = Field(32, ge=1, description="samples per optimizer step, all ranks")
    micro_batch_size: int = Field(8, ge=1, description="samples per forward pass on one rank")
    allow_global_batch_change: bool = Field(
        False, description="at a world size that cannot keep global_batch_size exactly, train with "
                           "the nearest multiple of micro_batch_size x data-parallel size instead of "
                           "refusing the spec")


# Strategies whose engine gathers the whole model to rank 0 (checkpoint.publish_to).
PUBLISHING = ("ddp", "fsdp", "tensor", "zero1", "zero2", "zero3")
Strategy = Literal["ddp", "fsdp", "zero1", "zero2", "zero3", "pipeline", "tensor", "local_sgd",
                   "parameter_server"]
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


class ParallelismSpec(Section):
    """How the world is split: a (pp, dp, tp) DeviceMesh with dp = world / (pp * tp).

    `strategy` names the data-parallel flavour over dp and turns on the model-parallel parts:
    ddp, local_sgd, parameter_server and zero1/2/3 are pure data parallel; fsdp shards over dp and composes with tp and pp
    (all three at once when the world size allows); pipeline splits the model into `pp` stages
    (DDP over any remaining dp); tensor shards every linear layer over all ranks (tp = world size).
    """

    strategy: Strategy = Field("ddp", description="how the model and its training are split over the workers (docs/parallelism.md)")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline stages (over ranks)")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="pipeline schedule (interleaved_1f1b needs stages_per_rank >= 2)")
    stages_per_rank: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved)")
    split_points: list[int] | None = Field(
        None, description="block index where each stage after the first begins; default: balanced"
    )
    cpu_offload: bool = Field(False, description="fsdp: parameters and optimizer state on CPU; "
                                                 "zero: optimizer state (and zero3 parameters) on CPU")
    activation_checkpointing: bool = Field(False, description="fsdp: recompute blocks in backward")
    compile: bool = Field(False, description="torch.compile each repeated block (ddp, fsdp, tensor, fsdp x tp, "
                                             "local_sgd): fused kernels, same math")
    mixed_precision: bool = Field(True, description="fsdp on GPU: bf16 compute, fp32 reduce")
    sync_every: int = Field(1, ge=1, description="local_sgd: local optimizer steps between parameter "
                                                 "averages (H; 1 with optim sgd is synchronous DDP)")
    num_servers: int = Field(1, ge=1, description="parameter_server: server actors the parameters are "
                                                  "partitioned across (by tensor, balanced by size)")
    max_staleness: int | None = Field(
        None, ge=0, description="parameter_server: a worker more than this many pushes ahead of the "
                                "slowest waits (bounded staleness); null: never waits (fully asynchronous)")

    @model_validator(mode="after")
    def _strategy_parts(self) -> ParallelismSpec:
        s = self.strategy
        if s in ("ddp", "local_sgd", "parameter_server", *ZERO_STAGES) and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"parallelism.strategy '{s}' is pure data parallel: parallelism.tp and "
                             f"parallelism.pp must be 1 (use 'fsdp' with tp, or 'pipeline' with pp)")
        if s == "pipeline" and (self.pp < 2 or self.tp > 1):
            raise ValueError("parallelism.strategy 'pipeline' needs parallelism.pp >= 2 and tp = 1")
        if s == "tensor" and (self.tp < 2 or self.pp > 1):
            raise ValueError("parallelism.strategy 'tensor' needs parallelism.tp >= 2 and pp = 1")
        if self.pp == 1 and (self.schedule == "interleaved_1f1b" or self.stages_per_rank > 1
                             or self.split_points):
            raise ValueError("parallelism.schedule, stages_per_rank and split_points apply to "
                             "pipeline parallelism (parallelism.pp >= 2) only")
        if self.sync_every > 1 and s != "local_sgd":
            raise ValueError(f"parallelism.sync_every applies to strategy 'local_sgd' only, not '{s}'")
        if (self.num_servers > 1 or self.max_staleness is not None) and s != "parameter_server":
            raise ValueError(f"parallelism.num_servers and max_staleness apply to strategy "
                             f"'parameter_server' only, not '{s}'")
        if self.compile and (s in ("parameter_server", *ZERO_STAGES) or self.pp > 1):
            raise ValueError(f"parallelism.compile compiles each block before the data-parallel wrapper: built for "
                             f"ddp, fsdp, tensor and local_sgd without pipeline stages, not strategy '{s}' with "
                             f"pp {self.pp} (DeepSpeed's engine and pipeline stages wrap the blocks their own way)")
        if (self.schedule == "interleaved_1f1b") != (self.stages_per_rank > 1):
            raise ValueError("parallelism.schedule 'interleaved_1f1b' goes with "
                             "parallelism.stages_per_rank >= 2, and only it")
        return self

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def dp_size(self, world_size: int) -> int | None:
        """Data-parallel degree at this world size, or None if pp * tp does not divide it."""
        model_parallel = self.pp * self.tp
        return None if world_size % model_parallel else world_size // model_parallel


class ScalingSpec(Section):
    num_workers: int | None = Field(None, ge=1, description="a fixed world size (default 2 unless min/max_workers)")
    min_workers: int | None = Field(None, ge=1, description="elastic: the fewest workers training goes on with")
    max_workers: int | None = Field(None, ge=1, description="elastic: the most workers it grows to")
    use_gpu: bool | Literal["auto"] = Field(
        "auto", description="auto: GPUs when the cluster has them (nccl, bf16 autocast), else CPU (gloo, fp32)")
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0},
                                                   description="Ray resources each worker reserves")
    max_failures: int = Field(3, ge=-1, description="worker-group restarts allowed after a worker fails, each "
                                                    "from the last checkpoint; 0: none; -1: forever")
    resize_check_interval_s: float = Field(
        10.0, gt=0, description="elastic: how often Ray Train (or, resized in place, the driver) looks for room "
                                "to grow the group")
    health_check_interval_s: float = Field(
        2.0, gt=0, description="how often Ray Train polls workers (failure detection delay)")
    recovery: Literal["restart", "hot"] = Field(
        "restart", description="restart: a failure restarts the worker group from the last "
                               "checkpoint; hot (ddp): survivors keep training and a replacement "
                               "heals from a live peer (TorchFT)")
    resize: Literal["restart", "in_place"] = Field(
        "restart", description="restart: a change of size restarts the worker group from a checkpoint (Ray "
                               "Train); in_place (ddp, fsdp): workers leave and join the running group at a "
                               "step boundary, joiners taking their state from a live peer")
    worker_start_timeout_s: float = Field(
        60.0, gt=0, description="how long a worker group may take to start before Ray Train "
                                "gives up on it and retries, elastic: at the size resources allow")

    @model_validator(mode="after")
    def _fixed_or_elastic(self) -> ScalingSpec:
        elastic = self.min_workers is not None or self.max_workers is not None
        if self.num_workers is not None and elastic:
            raise ValueError(
                "set either scaling.num_workers (fixed size) or scaling.min_workers and "
                "scaling.max_workers (elastic), not both"
            )
        if elastic and (self.min_workers is None or self.max_workers is None):
            raise ValueError("elastic scaling needs both scaling.min_workers and scaling.max_workers")
        if elastic and self.min_workers > self.max_workers:
            raise ValueError(
                f"scaling.min_workers ({self.min_workers}) exceeds "
                f"scaling.max_workers ({self.max_workers})"
            )
        if not elastic and self.num_workers is None:
            self.num_workers = 2
        return self

    @property
    def world_sizes(self) -> range:
        """Every world size this run may train at."""
        if self.num_workers is not None:
            return range(self.num_workers, self.num_workers + 1)
        return range(self.min_workers, self.max_workers + 1)

    @property
    def step_sizes(self) -> range:
        """Every number of ranks a step may run on: under hot recovery, any number of survivors."""
        return range(1, self.world_sizes.stop) if self.recovery == "hot" else self.world_sizes


class CheckpointSpec(Section):
    storage_path: str = Field(
        "runs", description="where runs live; relative paths resolve against the current directory"
    )
    every_n_steps: int = Field(50, ge=1, description="a checkpoint every N steps (and at the last)")
    keep: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")
    async_write: bool = Field(
        False, description="write and upload checkpoints in the background while training goes on")
    load_optimizer: bool = Field(
        True, description="resume with the checkpoint's optimizer state; false: weights, schedule and "
                          "data position only (when the optimizer changed, e.g. adamw -> sgd)")
    preempt_timeout_s: float = Field(
        60.0, gt=0, description="on SIGTERM (a preemption notice, `ray job stop`) the run checkpoints at the "
                                "next step boundary and exits; past this many seconds the driver exits anyway")
    lease_ttl_s: float = Field(
        30.0, ge=1, description="the run's lease is renewed every third of this; a launch that stopped "
                                "renewing is taken over after it, and one that lost its lease stops within a third")
    publish_to: str | None = Field(
        None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="a Serve app on the same cluster that "
        "follows this run: the weights are sent to it through Ray's object store every publish_every_n_steps, "
        "no storage read on the way (ddp, fsdp, tensor and zero strategies; a GPT or Hugging Face model)")
    publish_every_n_steps: int | None = Field(
        None, ge=1, description="publish_to: how often (default checkpoint.every_n_steps; and at the last step)")

    @field_validator("storage_path")
    @classmethod
    def _file_uri_is_a_path(cls, storage_path: str) -> str:
        return local_path_of(storage_path)  # a file:// URI is the local path it names (store.py)


class EvalSpec(Section):
    every_n_steps: int | None = Field(None, ge=1, description="validation loss every N steps (and at the last)")
    batches: int = Field(4, ge=1, description="global batches of validation samples per evaluation")


class RunSpec(Section):
    name: str = Field("gpt_ddp", description="the run's directory under checkpoint.storage_path")
    steps: int = Field(200, ge=1, description="optimizer steps in all (a resumed run trains up to this)")
    seed: int = Field(0, description="seeds the weights and the data order")
    log_every: int = Field(10, ge=1, description="metrics every N steps")
    precision: Literal["auto", "fp32", "bf16", "float8"] = Field(
        "auto", description="auto: bf16 autocast on GPU, fp32 on CPU; float8: the blocks' matmuls in float8 "
                            "(torchao, GPUs of compute capability 8.9+), bf16 elsewhere"
    )
    sample_ledger: bool = Field(
        False, description="record every step's sample ids per rank under <run>/ledger (audits)"
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a step whose loss or gradient norm is not finite: stop the run naming the step "
                            "(nothing from it is committed), or skip the step's update and go on")
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="experiment trackers that get every logged step besides metrics.jsonl: tensorboard (event "
                    "files in the run directory), mlflow, wandb (extra shardyard[tracking])")
    experiment: str = Field("shardyard", min_length=1,
                            description="the MLflow experiment, or the Weights & Biases project, the run is filed under")
    peak_tflops: float | None = Field(
        None, gt=0, description="one device's peak TFLOP/s that MFU is computed against, for devices shardyard "
                                "does not know (CPUs, unlisted GPUs); unset: the GPU's dense bf16 peak where known")
    tracking_uri: str | None = Field(
        None, description="the MLflow tracking server (http://host:5000); unset: MLflow's own MLFLOW_TRACKING_URI")

    @field_validator("loggers")
    @classmethod
    def _trackers_installed(cls, loggers: list[str]) -> list[str]:
        clients = {"mlflow": "mlflow", "wandb": "wandb"}
        missing = [name for name in loggers if name in clients and importlib.util.find_spec(clients[name]) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} named but not installed: pip install 'shardyard[tracking]'")
        return list(dict.fromkeys(loggers))

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        # "." or ".." (or a "/") would put the run's directory outside checkpoint.storage_path.
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or set(name) == {"."}:
            raise ValueError("must be one directory name: letters, digits, '_', '.', '-', and not only dots")
        return name
