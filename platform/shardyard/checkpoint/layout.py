"""What a checkpoint directory holds, and reading the spec stored in it.

A checkpoint is a directory `<storage_path>/<run.name>/checkpoint_step_<step:08d>/` holding:

    spec.json          the job spec that wrote it (rank 0, before anything else)
    trainer_state.pt   train state (step, data position, world size) and the LR schedule (rank 0)
    model + optimizer  in the format of the engine that wrote it: DCP files (every rank writing
                       its own shard, keyed by the full model's parameter names whatever the
                       strategy), or DeepSpeed's own under `zero/`
    COMMITTED          the commit record (record.py), written last

A stored spec is data, not code: it is read without importing anything it names. A custom model
factory is imported only from a spec the user launched, or named by the user when serving or
exporting (`trust_factory`), never because a file in a run directory says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardyard.spec import FACTORY_MODELS, LANGUAGE_MODELS, STORED, DataSpec, HFSpec, JobSpec, SpecError

STATE_FILE = "trainer_state.pt"
SPEC_FILE = "spec.json"
ZERO_DIR = "zero"


@dataclass
class TrainState:
    step: int = 0          # optimizer steps completed
    samples_seen: int = 0  # global position in the sample order (see data/sampler.py)
    world_size: int = 1    # world size that wrote the checkpoint


class UntrustedFactory(SpecError):
    """A checkpoint of a custom model read without the user naming its factory."""


def stored_spec(data: bytes | str) -> JobSpec:
    """A spec as a checkpoint stores it, validated without importing what it names; a custom
    model section refuses to call its factory (`trusted` gives one that may)."""
    spec = JobSpec.model_validate(json.loads(data), context=STORED)
    if isinstance(spec.model, FACTORY_MODELS):
        spec.model._from_storage = True
    return spec


def trusted(stored: JobSpec, where: str, trust_factory: str | None) -> JobSpec:
    """`stored`, safe to build: a custom model's factory is the one the user named."""
    if not isinstance(stored.model, FACTORY_MODELS):
        return stored
    if trust_factory is None:
        raise UntrustedFactory(
            f"{where} was trained with the model factory '{stored.model.factory}', named by a file in "
            f"the run directory; shardyard imports a factory only when you name it: pass --trust-factory "
            f"{stored.model.factory} (serving: trust_factory) if you trust that code")
    model = type(stored.model).model_validate(stored.model.model_dump() | {"factory": trust_factory})
    return stored.model_copy(update={"model": model})


def is_hf_directory(path: str | Path) -> bool:
    """A Hugging Face model directory that training did not write (config.json, no spec.json)."""
    return (Path(path) / "config.json").is_file() and not (Path(path) / SPEC_FILE).is_file()


def positions_of(config: Any) -> int | None:
    """The positions a Hugging Face config gives its model (None where it names none)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def serving_context(model: Any) -> int:
    """The tokens a model is served with: a GPT's or custom module's block_size (learnt positions
    stop there); a Hugging Face model's every position, not only the sequence length it was
    trained at (a run trained at 64 tokens of a 256-position Llama serves 256), and no wider than
    a sliding window (the KV cache holds every past token, which a narrower window would not read)."""
    if not isinstance(model, HFSpec):
        return model.block_size
    config = model.hf_config()
    window = getattr(config, "sliding_window", None)  # layers slide as serve/executor/model_pass.py reads them
    slides = "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention" if window else ""])
    widest = [n for n in (positions_of(config), window if slides else None) if n]
    return max(model.block_size, min(widest)) if widest else model.block_size


def serving_spec(checkpoint_dir: str | Path) -> JobSpec:
    """The spec a checkpoint is served with: read_spec's, its model's block_size the serving context."""
    spec = read_spec(checkpoint_dir)
    if not isinstance(spec.model, LANGUAGE_MODELS):  # no context: the MLP, a module of the user's own
        return spec
    context = serving_context(spec.model)
    if context == spec.model.block_size:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"block_size": context})})


def read_spec(checkpoint_dir: str | Path) -> JobSpec:
    """The spec a checkpoint was trained with, as data (`trusted` makes it buildable). A Hugging
    Face model directory has none: it gets one that loads it as it is, with the model's whole
    context window (for serving it)."""
    if is_hf_directory(checkpoint_dir):
        config = HFSpec.model_construct(path=str(checkpoint_dir), config=None).hf_config()
        window = positions_of(config) or 2048
        return JobSpec(model=HFSpec(path=str(checkpoint_dir), block_size=window), data=DataSpec(name="synthetic"))
    return stored_spec((Path(checkpoint_dir) / SPEC_FILE).read_text())
