"""Where rank 0's metrics go besides `metrics.jsonl`: the experiment trackers named in
`run.loggers`, each through its own client.

- tensorboard: event files under the run directory (local storage only).
- mlflow: a run in `run.experiment` on the tracking server `run.tracking_uri` (or MLflow's own
  MLFLOW_TRACKING_URI); its parameters are the resolved job spec, flattened. The MLflow run's id
  is kept in the shardyard run's directory, so launching the run again (longer, at another world
  size, after a crash) goes on in the same MLflow run instead of starting a new one.
- wandb: a Weights & Biases run in project `run.experiment`, id kept the same way; offline
  unless the environment says otherwise (WANDB_MODE, or an API key with WANDB_MODE=online).

A client that is not installed is refused when the spec is checked (spec/sections.py), before any worker
starts, naming the extra that brings it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from shardyard.storage.store import RunStorage
from shardyard.spec import JobSpec

TENSORBOARD_DIR = "tensorboard"
SCALARS = ("loss", "lr", "tokens_per_s", "samples_per_s", "step_time_s", "world_size", "model_tflops_per_s",
           "mfu", "peak_memory_gib", "grad_norm")

class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers, named as every tracker shows them: train/... and validation/..."""
    out = {f"train/{key}": float(row[key]) for key in SCALARS if isinstance(row.get(key), (int, float))}
    # val_loss, a language model's val_perplexity, a task of the user's own's metrics.factory values
    out |= {f"validation/{key.removeprefix('val_')}": float(value) for key, value in row.items()
            if key.startswith("val_") and isinstance(value, (int, float))}
    return out


def flat_config(spec: JobSpec) -> dict[str, str]:
    """The resolved spec as `section.key` -> value: what a tracker shows as the run's parameters."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            out[prefix] = str(value)

    walk("", spec.model_dump(mode="json"))
    return out


class TensorBoard:
    def __init__(self, spec: JobSpec) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(spec.run_uri) / TENSORBOARD_DIR))

    def log(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def kept_id(spec: JobSpec, name: str) -> str | None:
    """The tracker's run id an earlier launch of this run kept in its directory."""
    storage = RunStorage(spec.run_uri)
    return storage.read_bytes(name).decode().strip() if storage.exists(name) else None


def keep_id(spec: JobSpec, name: str, run_id: str) -> None:
    RunStorage(spec.run_uri).write_bytes(run_id.encode(), name)


class MLflow:
    ID_FILE = "mlflow_run_id"

    def __init__(self, spec: JobSpec) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=spec.run.tracking_uri)
        known = kept_id(spec, self.ID_FILE)
        if known:
            self.run_id = known
            self.client.update_run(known, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(spec.run.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(spec.run.experiment))
            self.run_id = self.client.create_run(experiment_id, run_name=spec.run.name,
                                                 tags={"shardyard.run_dir": spec.run_uri}).info.run_id
            keep_id(spec, self.ID_FILE, self.run_id)
            # The spec of the first launch; a relaunch's differences (more steps, another world
            # size) show in its metrics, and MLflow refuses to change a logged parameter.
            params = [Param(key, value[:6000]) for key, value in flat_config(spec).items()]  # MLflow's value limit
            for start in range(0, len(params), 100):  # MLflow's per-call limit
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        millis = int(row.get("time", 0) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, millis, row["step"])
                                                    for name, value in scalars(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB:
    ID_FILE = "wandb_run_id"

    def __init__(self, spec: JobSpec) -> None:
        import wandb

        known = kept_id(spec, self.ID_FILE)
        run_id = known or uuid.uuid4().hex[:12]  # W&B takes any unique id of letters and digits
        if not known:
            keep_id(spec, self.ID_FILE, run_id)
        local = "://" not in spec.run_uri
        self.run = wandb.init(project=spec.run.experiment, name=spec.run.name, id=run_id, resume="allow",
                              config=spec.model_dump(mode="json"), mode=os.environ.get("WANDB_MODE", "offline"),
                              dir=spec.run_uri if local else None)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def open_trackers(spec: JobSpec) -> list[Tracker]:
    """The trackers `run.loggers` names (tensorboard only on local storage, where its files go)."""
    names = [n for n in spec.run.loggers if n != "tensorboard" or "://" not in spec.run_uri]
    return [TRACKERS[name](spec) for name in names]
