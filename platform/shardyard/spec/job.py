"""The job spec: its sections together, the rules that cross them (asking the model family's
capabilities and the mesh planner, layout/), and loading it from YAML with every path made
absolute, so that every worker and the serving side agree on where runs and data live."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, model_validator

from shardyard.spec.base import Section, SpecError, read_from_storage, validate
from shardyard.spec.loading import read_yaml
from shardyard.spec.models import GPTSpec, ModelSpec
from shardyard.spec.sections import (PUBLISHING, ZERO_STAGES, BatchSpec, CheckpointSpec, DataSpec, EvalSpec,
                                     LossSpec, MetricsSpec, OptimSpec, ParallelismSpec, RunSpec, ScalingSpec)
from shardyard.storage.store import local_path_of


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
    loss: LossSpec | None = Field(None, description="the loss of a task of the user's own (model.name 'module')")
    metrics: MetricsSpec | None = Field(None, description="validation metrics of a task of the user's own "
                                        "(model.name 'module', with eval.every_n_steps)")

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
        self._check_own_task()
        if (self.data.name == "corpus" and self.model.name != "mlp" and self.model.vocab_size < 256
                and not getattr(self.model, "brings_tokenizer", False)):
            raise ValueError(f"data.name 'corpus' yields byte ids 0-255 for a model without a tokenizer: "
                             f"the model's vocab_size ({self.model.vocab_size}) must be at least 256")
        if self.eval.every_n_steps is not None and self.parallelism.strategy == "parameter_server":
            raise ValueError("eval.every_n_steps is not supported with parallelism.strategy 'parameter_server'")
        if self.eval.every_n_steps is not None and self.data.name not in ("shards", "factory"):
            raise ValueError("eval.every_n_steps needs data.name 'shards' (a validation split, or "
                             "data.validation_path) or 'factory' (data.validation_options)")
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
                                                       or self.model.name in ("custom", "module")):
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
        self._check_in_place()
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

    def _check_own_task(self) -> None:
        """A task of the user's own: their module, their dataset and their loss, together."""
        own = self.model.name == "module"
        if own and self.data.name != "factory":
            raise ValueError("model.name 'module' trains on a dataset of the user's own: data.name 'factory' with "
                             "data.factory")
        if own and self.loss is None:
            raise ValueError("model.name 'module' needs loss.factory: the loss of its output and the batch")
        if not own and self.loss is not None:
            raise ValueError(f"loss.factory is the loss of a module of the user's own (model.name 'module'); "
                             f"model.name '{self.model.name}' has its own")
        if not own and self.data.name == "factory":
            raise ValueError(f"data.name 'factory' feeds a module of the user's own (model.name 'module'), not "
                             f"model.name '{self.model.name}'")
        if not own and self.metrics is not None:
            raise ValueError(f"metrics.factory measures a module of the user's own (model.name 'module'); "
                             f"model.name '{self.model.name}' is validated by its loss and perplexity")
        validates = self.eval.every_n_steps is not None
        if self.metrics is not None and not validates:
            raise ValueError("metrics.factory is computed at validation: set eval.every_n_steps and "
                             "data.validation_options")
        if own and validates != (self.data.validation_options is not None):
            raise ValueError("eval.every_n_steps validates a task of the user's own on data.validation_options "
                             "(data.factory's options for the validation split): set both, or neither")

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

    def _check_in_place(self) -> None:
        par = self.parallelism
        if self.scaling.resize != "in_place":
            return
        if par.strategy not in ("ddp", "fsdp") or par.pp > 1 or par.tp > 1 or self.scaling.recovery == "hot":
            hot = " under scaling.recovery hot" if self.scaling.recovery == "hot" else ""
            # DeepSpeed makes an optimizer's state at its first step and reshards ZeRO's state to
            # another data-parallel size only through a checkpoint: a new group has none to take in.
            zero = " (DeepSpeed reshards ZeRO's state only through a checkpoint)" if par.strategy in ZERO_STAGES else ""
            raise ValueError(f"scaling.resize 'in_place' hands the whole model between group sizes: built for ddp and "
                             f"fsdp without pipeline or tensor parallelism, not strategy '{par.strategy}' with pp "
                             f"{par.pp} and tp {par.tp}{hot}{zero}; leave scaling.resize at 'restart' (a checkpoint "
                             f"and a restart at the new size)")

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


def load_spec(path: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a YAML job spec (or a mapping of what it would hold, or start from defaults), apply
    `key.path=value` overrides, validate."""
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
