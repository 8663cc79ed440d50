"""The job spec: one YAML file parsed into typed, validated config objects, and its loading
(`base:` files, `--set` overrides, messages that name the key and the valid choices).

Everything a run needs is decided when a spec is validated, before any Ray worker starts: unknown
keys, wrong types and impossible combinations raise `SpecError`. What a model can be split into
is its family's own rule (layout/capabilities.py) and how a run lays out at each world size it may
train at is the mesh planner's (layout/world_size.py): validation asks both, importing them
only then (and transformers only for a Hugging Face model, whose config it checks).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from shardyard.storage.store import local_path_of


class SpecError(ValueError):
    """A job spec that cannot run. The message is meant for the user, not a traceback."""


class Section(BaseModel):
    # extra="forbid" is what turns a misspelled key into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GPTSpec(Section):
    name: Literal["gpt"] = "gpt"
    n_layer: int = Field(4, ge=1, description="transformer blocks")
    n_head: int = Field(4, ge=1, description="attention heads per block (divides n_embd)")
    n_embd: int = Field(128, ge=1, description="hidden size")
    block_size: int = Field(64, ge=2, description="context length in tokens")
    vocab_size: int = Field(256, ge=2, description="256 for the byte-level corpus")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability while training")
    tie_weights: bool = Field(True, description="the output layer shares the token embedding (false for pipeline parallelism)")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTSpec:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        return self


class MLPSpec(Section):
    name: Literal["mlp"] = "mlp"
    in_dim: int = Field(32, ge=1, description="input features")
    hidden_dim: int = Field(64, ge=1, description="width of each hidden layer")
    out_dim: int = Field(8, ge=1, description="outputs")
    n_layer: int = Field(3, ge=1, description="number of hidden layers")


# What marks a Hugging Face model directory as bringing its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class HFSpec(Section):
    """A Hugging Face causal LM: a local model directory to fine-tune, or a config to pretrain."""

    name: Literal["hf"] = "hf"
    path: str | None = Field(None, description="local Hugging Face model directory (config.json and "
                             "weights) to fine-tune; when given, its config replaces model.config")
    config: dict[str, Any] | None = Field(
        None, description="pretrain from scratch: `architecture` (llama, gpt2, qwen2, ...) and the "
        "Hugging Face config's own keys (hidden_size, num_hidden_layers, vocab_size, ...)")
    block_size: int = Field(64, ge=2, description="training sequence length in tokens")

    @model_validator(mode="before")
    @classmethod
    def _directory_replaces_config(cls, data: Any) -> Any:
        # `--set model.path=DIR` on a pretraining spec means "this model instead": the directory
        # brings its own config, and weights that only fit it.
        if isinstance(data, dict) and data.get("path") is not None and data.get("config") is not None:
            data = {**data, "config": None}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> HFSpec:
        if self.path is None and self.config is None:
            raise ValueError("model.name 'hf' needs model.path (a model directory) or model.config "
                             "(architecture and config keys)")
        if self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(f"model.path '{self.path}' is not a Hugging Face model directory "
                             f"(no config.json in it)")
        if self.config is not None and "architecture" not in self.config:
            raise ValueError("model.config needs `architecture`, the Hugging Face model type "
                             "(llama, gpt2, qwen2, mistral, ...)")
        config = self.hf_config()  # transformers' own validation of the keys, before any worker
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit is not None and self.block_size > limit:
            raise ValueError(f"model.block_size ({self.block_size}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return self

    def hf_config(self) -> Any:
        """The model's `transformers` config (imported here: only Hugging Face specs need it)."""
        from transformers import CONFIG_MAPPING, AutoConfig

        if self.path is not None:
            try:
                return AutoConfig.from_pretrained(self.path)
            except (ValueError, OSError) as err:
                raise ValueError(f"model.path: transformers cannot read its config.json: {err}") from None
        architecture = self.config["architecture"]
        if architecture not in CONFIG_MAPPING:
            raise ValueError(f"model.config.architecture '{architecture}' is not a model type transformers "
                             f"knows (llama, gpt2, qwen2, mistral, ...)")
        try:
            return AutoConfig.for_model(architecture, **{k: v for k, v in self.config.items() if k != "architecture"})
        except Exception as err:  # noqa: BLE001 - transformers' validators raise several kinds
            reason = str(err).strip().splitlines()[-1].strip()
            raise ValueError(f"model.config: transformers refused it: {reason}") from None

    @property
    def vocab_size(self) -> int:
        return self.hf_config().vocab_size

    @property
    def brings_tokenizer(self) -> bool:
        """A model directory with tokenizer files: text is tokenized with it, in training and serving."""
        return self.path is not None and any((Path(self.path) / name).is_file() for name in TOKENIZER_FILES)

STORED = {"stored": True}  # validation context of a spec read from a checkpoint


def read_from_storage(info: ValidationInfo) -> bool:
    """Whether the spec being validated was read from a checkpoint (not launched by the user)."""
    return bool(info.context and info.context.get("stored"))


class CustomSpec(Section):
    """The user's own `nn.Module`: `factory` returns it, given this section."""

    name: Literal["custom"] = "custom"
    factory: str = Field(description="'package.module:function'; called with this section, returns an "
                         "nn.Module mapping token ids (B, T) to logits (B, T, vocab_size)")
    block_size: int = Field(64, ge=2, description="training sequence length in tokens")
    vocab_size: int = Field(256, ge=2, description="256 for the byte-level corpus")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the factory as they are")
    # Set on a section read from a checkpoint (checkpoint/layout.py): its factory is never called.
    _from_storage: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _factory_exists(self, info: ValidationInfo) -> CustomSpec:
        module, _, function = self.factory.partition(":")
        if not module or not function:
            raise ValueError(f"model.factory must be 'package.module:function', got '{self.factory}'")
        if read_from_storage(info):  # a stored spec's factory is never imported (checkpoint/layout.py)
            return self
        try:
            found = getattr(importlib.import_module(module), function, None)
        except ImportError as err:
            raise ValueError(f"model.factory: cannot import '{module}': {err} (shardyard imports it from the directory "
                             f"it runs in, an installed package or PYTHONPATH; on a cluster, submit the job with "
                             f"`ray job submit --working-dir .`)") from None
        if not callable(found):
            raise ValueError(f"model.factory: '{module}' has no function '{function}'")
        return self

    def build(self) -> Any:
        """Call the factory (the models package checks what it returns)."""
        if self._from_storage:
            raise SpecError(f"model.factory '{self.factory}' is named by a spec stored in a run directory; it is "
                            f"imported only when the reader names it (--trust-factory, serving: trust_factory)")
        module, _, function = self.factory.partition(":")
        return getattr(importlib.import_module(module), function)(self)


ModelSpec = Annotated[Union[GPTSpec, MLPSpec, HFSpec, CustomSpec], Field(discriminator="name")]
# Models that read token ids and predict the next one: the corpus and token data feed them.
LANGUAGE_MODELS = (GPTSpec, HFSpec, CustomSpec)


class DataSpec(Section):
    name: Literal["corpus", "synthetic", "shards"] = Field(
        "corpus", description="corpus: byte-level text read into memory; shards: what `shardyard prepare` wrote; "
        "synthetic: random regression data (the MLP)")
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

    @model_validator(mode="after")
    def _shards_have_a_path(self) -> DataSpec:
        if self.name == "shards" and not self.path:
            raise ValueError("data.name 'shards' needs data.path: the directory `shardyard prepare` wrote")
        return self


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
        10.0, gt=0, description="elastic: how often Ray Train looks for room to grow the group")
    health_check_interval_s: float = Field(
        2.0, gt=0, description="how often Ray Train polls workers (failure detection delay)")
    recovery: Literal["restart", "hot"] = Field(
        "restart", description="restart: a failure restarts the worker group from the last "
                               "checkpoint; hot (ddp): survivors keep training and a replacement "
                               "heals from a live peer (TorchFT)")
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


class JobSpec(Section):
    model: ModelSpec = Field(default_factory=GPTSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)

    @model_validator(mode="before")
    @classmethod
    def _model_defaults_to_gpt(cls, data: Any) -> Any:
        # The model section is a tagged union on `name`; a spec that omits it means the GPT.
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "name" not in data["model"]:
            data = {**data, "model": {"name": "gpt", **data["model"]}}
        return data

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo) -> JobSpec:
        if self.model.name == "mlp" and self.data.name != "synthetic":
            raise ValueError("model.name 'mlp' trains on data.name 'synthetic' only")
        if (self.data.name == "corpus" and self.model.name != "mlp" and self.model.vocab_size < 256
                and not getattr(self.model, "brings_tokenizer", False)):
            raise ValueError(f"data.name 'corpus' yields byte ids 0-255 for a model without a tokenizer: "
                             f"the model's vocab_size ({self.model.vocab_size}) must be at least 256")
        if self.eval.every_n_steps is not None and self.parallelism.strategy == "parameter_server":
            raise ValueError("eval.every_n_steps is not supported with parallelism.strategy 'parameter_server'")
        if self.eval.every_n_steps is not None and self.data.name != "shards":
            raise ValueError("eval.every_n_steps needs data.name 'shards' (a validation split, or data.validation_path)")
        if self.data.validation_path is not None and self.data.name != "shards":
            raise ValueError("data.validation_path applies to data.name 'shards' only")
        if self.data.path is not None and self.data.name == "synthetic":
            raise ValueError("data.path applies to data.name 'corpus' and 'shards', not 'synthetic'")
        par = self.parallelism
        if par.strategy == "tensor" and any(ws != par.tp for ws in self.scaling.world_sizes):
            raise ValueError(f"parallelism.strategy 'tensor' shards over every rank: parallelism.tp "
                             f"({par.tp}) must equal the world size (for dp x tp use 'fsdp' with tp)")
        fixed = self.scaling.num_workers
        if fixed is not None and par.dp_size(fixed) is None:  # a fixed size is meant: no re-plan
            raise ValueError(f"world size {fixed} is not a multiple of parallelism.pp x "
                             f"parallelism.tp = {par.pp} x {par.tp}")
        if par.strategy == "local_sgd" and self.checkpoint.every_n_steps % par.sync_every:
            raise ValueError(f"checkpoint.every_n_steps ({self.checkpoint.every_n_steps}) must be a multiple "
                             f"of parallelism.sync_every ({par.sync_every}): a checkpoint holds averaged "
                             f"parameters, which ranks share only right after an average")
        if (par.strategy in ZERO_STAGES and self.optim.name == "sgd" and self.optim.momentum
                and len(self.scaling.world_sizes) > 1 and self.checkpoint.load_optimizer):
            raise ValueError("elastic ZeRO with SGD momentum cannot resume at another world size: DeepSpeed "
                             "reshards Adam's state only. Use optim.name adamw, a fixed scaling.num_workers, "
                             "or checkpoint.load_optimizer=false")
        if par.strategy == "parameter_server":
            self._check_parameter_server()
        if self.checkpoint.publish_to is not None and (par.strategy not in PUBLISHING or par.pp > 1
                                                       or self.model.name == "custom"):
            raise ValueError(f"checkpoint.publish_to sends the whole model from rank 0: built for the ddp, fsdp, "
                             f"tensor and zero1/2/3 strategies without pipeline stages and a GPT or Hugging Face "
                             f"model, not parallelism.strategy '{par.strategy}' with pp {par.pp} and model.name "
                             f"'{self.model.name}'")
        if self.run.on_nonfinite == "skip" and (par.strategy in ZERO_STAGES or par.strategy == "parameter_server"
                                                 or self.scaling.recovery == "hot"):
            raise ValueError(f"run.on_nonfinite 'skip' is not available with parallelism.strategy "
                             f"'{par.strategy}'{' and scaling.recovery hot' if self.scaling.recovery == 'hot' else ''}: "
                             f"its engine applies each step as it computes it; use 'stop'")
        if read_from_storage(info):  # checked when it was launched; checking again may run its factory
            return self
        self._check_hot_recovery()
        self._check_float8()
        # What the model can be split into, and the run at every size it may train at: asked of the
        # model family's own rules (layout/capabilities.py) and the mesh planner (parallel/).
        from shardyard.layout.capabilities import check_fits_mesh
        from shardyard.layout.world_size import at_world_size

        check_fits_mesh(self.model, par)
        if par.strategy != "parameter_server":  # its batches do not depend on how many are alive
            for ws in self.scaling.step_sizes:
                at_world_size(self, ws)  # raises, naming the key, if nothing can run at this size
        return self

    def _check_parameter_server(self) -> None:
        slots, batch = self.scaling.world_sizes[-1], self.batch
        if batch.global_batch_size % (batch.micro_batch_size * slots):
            raise ValueError(f"parallelism.strategy 'parameter_server' splits batch.global_batch_size "
                             f"({batch.global_batch_size}) into one batch per worker slot ({slots}: "
                             f"scaling.num_workers or max_workers), each a multiple of "
                             f"batch.micro_batch_size ({batch.micro_batch_size})")
        if self.scaling.recovery != "restart" or self.checkpoint.async_write:
            raise ValueError("parallelism.strategy 'parameter_server' runs its own actors: scaling.recovery "
                             "'hot' and checkpoint.async_write are for Ray Train strategies")

    def _check_float8(self) -> None:
        par = self.parallelism
        if self.run.precision != "float8":
            return
        if par.strategy not in ("ddp", "fsdp", "local_sgd") or par.tp > 1 or par.pp > 1:
            raise ValueError(f"run.precision float8 converts the blocks' linears before the data-parallel wrapper: "
                             f"built for ddp, fsdp and local_sgd without tensor or pipeline parallelism, not "
                             f"strategy '{par.strategy}' with tp {par.tp} and pp {par.pp}")
        if importlib.util.find_spec("torchao") is None:
            raise ValueError("run.precision float8 runs on torchao, which is not installed: pip install 'shardyard[float8]'")

    def _check_hot_recovery(self) -> None:
        if self.scaling.recovery != "hot":
            return
        if self.parallelism.strategy != "ddp":
            raise ValueError("scaling.recovery 'hot' keeps whole-model replicas training: it needs "
                             f"parallelism.strategy 'ddp', not '{self.parallelism.strategy}' (Ray Train "
                             f"replaces failed replicas one worker at a time)")
        if self.scaling.num_workers is None:
            raise ValueError("scaling.recovery 'hot' needs a fixed scaling.num_workers: survivors "
                             "train on while Ray Train replaces the failed workers")
        if "://" in self.checkpoint.storage_path:
            raise ValueError("scaling.recovery 'hot' writes checkpoints straight to a local or "
                             "shared filesystem: checkpoint.storage_path cannot be a URI")
        if importlib.util.find_spec("torchft") is None:  # an extra: it has no wheels for every platform
            raise ValueError("scaling.recovery 'hot' runs on TorchFT, which is not installed: "
                             "pip install 'shardyard[hot]'")

    @property
    def run_dir(self) -> Path:
        """The run's directory on local or shared storage."""
        return Path(self.checkpoint.storage_path) / self.run.name

    @property
    def run_uri(self) -> str:
        """The run's directory as storage sees it: a local path, or an object-store URI."""
        return f"{self.checkpoint.storage_path.rstrip('/')}/{self.run.name}"


# ----------------------------------------------------------------------------- loading


def read_yaml(path: str | Path | None, overrides: list[str] | tuple[str, ...], what: str) -> dict[str, Any]:
    """A YAML spec file as a mapping (empty without a file), with `key.path=value` overrides applied.
    A file may extend another (`base: other.yaml`, relative to the file): its keys are merged into
    the base's, section by section, and the overrides come last."""
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


def load_spec(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a YAML job spec (or start from defaults), apply `key.path=value` overrides, validate."""
    spec = parse_spec(read_yaml(path, overrides, "job spec"))
    refuse_storage_in_job_copy(spec.checkpoint.storage_path)
    # Absolute, so that Ray Train workers and the serving side agree on where runs and data live.
    spec.checkpoint.storage_path = _absolute_storage(spec.checkpoint.storage_path)
    for key in ("path", "validation_path"):
        if getattr(spec.data, key) is not None:
            setattr(spec.data, key, _absolute_storage(getattr(spec.data, key)))
    return spec


def parse_spec(raw: dict[str, Any]) -> JobSpec:
    return validate(JobSpec, raw, "invalid job spec")


Model = typing.TypeVar("Model", bound=BaseModel)


def validate(cls: type[Model], raw: dict[str, Any], title: str) -> Model:
    """`cls` from `raw`, or a SpecError whose message names each bad key (see explain_errors)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise SpecError(explain_errors(err, cls, title)) from None


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


# Where `ray job submit --working-dir DIR` unpacks DIR for a job: the job's current directory.
RAY_JOB_COPY = f"{os.sep}runtime_resources{os.sep}working_dir_files{os.sep}"


def refuse_storage_in_job_copy(storage_path: str) -> None:
    """A relative checkpoint.storage_path in a job submitted with `--working-dir` would put the run
    in Ray's copy of that directory, under Ray's session (deleted with it, and not where the user
    resumes or serves from): refused, saying how to name the place meant."""
    here = os.getcwd()
    if "://" in storage_path or Path(storage_path).expanduser().is_absolute() or RAY_JOB_COPY not in here + os.sep:
        return
    raise SpecError(
        f"checkpoint.storage_path {storage_path!r} is relative, and this job runs in Ray's copy of its "
        f"--working-dir ({here}), which Ray deletes: the run would be written there, not where you resume or "
        f"serve it. Give a path every node reaches: --set checkpoint.storage_path=/shared/runs, an s3:// or "
        f"gs:// URI, or on a one-machine cluster the directory you submit from "
        f"(--set checkpoint.storage_path=$PWD/runs)")


def _absolute_storage(path: str) -> str:
    path = local_path_of(path)
    if "://" in path:  # s3://, gs://, ... are handed to Ray Train's storage layer as they are
        return path
    return str(Path(path).expanduser().resolve())


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
            cls = next((m for m in _members(cls) if m.model_fields["name"].default == part), None)
            pending_union = False
            continue
        names.append(str(part))
        parent = cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        field = parent.model_fields.get(str(part)) if parent else None
        cls = field.annotation if field else None
        pending_union = len(_members(cls)) > 1
    return ".".join(names), parent


def _members(annotation: Any) -> list[type[BaseModel]]:
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []
