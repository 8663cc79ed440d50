"""The job spec: one YAML file parsed into typed, validated config objects, and its loading
(`base:` files, `--set` overrides, messages that name the key and the valid choices).

Everything a run needs is decided when a spec is validated, on the driver, before any Ray worker
starts: unknown keys, wrong types and impossible combinations raise `SpecError`, and the workers
are handed the spec already checked. What a model can be split into is its family's own rule
(layout/capabilities.py) and how a run lays out at each world size it may train at is the mesh
planner's (layout/world_size.py): validation asks both, importing them only then (and
transformers only for a Hugging Face model, whose config it checks).

    base.py      sections, errors that name the key, did-you-mean
    loading.py   YAML, `base:` files, `--set` overrides
    factories.py the user's functions a spec names ('package.module:function')
    models.py    the model section (gpt, mlp, hf, custom, module)
    sections.py  data, loss, metrics, optim, batch, parallelism, scaling, checkpoint, eval, run
    job.py       JobSpec, the rules across its sections, load_spec
"""

from shardyard.spec.base import STORED, Section, SpecError, did_you_mean, members, read_from_storage, validate
from shardyard.spec.job import JobSpec, load_spec, parse_spec, refuse_storage_in_job_copy
from shardyard.spec.loading import apply_override, read_yaml
from shardyard.spec.models import (FACTORY_MODELS, LANGUAGE_MODELS, TOKENIZER_FILES, CustomSpec, GPTSpec, HFSpec, MLPSpec,
                                   ModelSpec, ModuleSpec)
from shardyard.spec.sections import (PUBLISHING, ZERO_STAGES, BatchSpec, CheckpointSpec, DataSpec, EvalSpec, LossSpec,
                                     MetricsSpec, OptimSpec, ParallelismSpec, RunSpec, ScalingSpec, Strategy)

__all__ = ["STORED", "Section", "SpecError", "did_you_mean", "members", "read_from_storage", "validate", "JobSpec",
           "load_spec", "parse_spec", "refuse_storage_in_job_copy", "apply_override", "read_yaml", "FACTORY_MODELS",
           "LANGUAGE_MODELS", "ModuleSpec", "LossSpec", "MetricsSpec",
           "TOKENIZER_FILES", "CustomSpec", "GPTSpec", "HFSpec", "MLPSpec", "ModelSpec", "PUBLISHING", "ZERO_STAGES",
           "BatchSpec", "CheckpointSpec", "DataSpec", "EvalSpec", "OptimSpec", "ParallelismSpec", "RunSpec",
           "ScalingSpec", "Strategy"]
