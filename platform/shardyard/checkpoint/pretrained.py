"""A Hugging Face model directory's weights, read by the checkpoint side as a run's first weights.

The model (models/hf.py) is built from the directory's config, on the meta device where a strategy
splits it; the engine shards or splits it and gives each rank's part storage; then the weights are
read here, each rank reading only the tensors or slices it holds (`fill`: DCP reads the safetensors
files straight into the sharded state dict), or one whole tensor at a time (`tensor`: ZeRO-3's rank
0 fills one gathered unit after another). Names are the model's own, `hf.` and the file's key.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from shardyard.layout.blocks import names_of_each_parameter
from shardyard.layout.dcp_placements import through_stand_ins
from shardyard.models.initial_weights import copy_local
from shardyard.spec import CustomSpec, GPTSpec, HFSpec, MLPSpec

PREFIX = "hf."  # what models/hf.py's wrapper adds to each of transformers' names


def pretrained_weights(spec: GPTSpec | MLPSpec | HFSpec | CustomSpec) -> PretrainedWeights | None:
    """The weights a model section starts from when they are not drawn at random: a model
    directory's (None for everything else)."""
    return PretrainedWeights(Path(spec.path)) if isinstance(spec, HFSpec) and spec.path is not None else None


class PretrainedWeights:
    """One model directory's weights (models.initial_weights.InitialWeights)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def fill(self, part: nn.Module) -> None:
        """Fill `part` (the model or a part of it: built on the meta device, perhaps sharded or
        split off, and given storage) with its tensors or slices of the directory's weights.
        Non-persistent buffers (rotary frequencies) are not in the files: models.give_storage
        computed them."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader, load

        targets = {name.removeprefix(PREFIX): tensor for name, tensor in part.state_dict(keep_vars=True).items()}
        if not self._stored_under_the_models_names(part):
            converted = self._converted_weights
            for name, target in targets.items():
                copy_local(target, converted[name])
            return
        # A tied head is one tensor under two names; the files hold it once.
        with through_stand_ins({k: v.detach() for k, v in targets.items() if k in self._stored_keys}) as read:
            load(read, storage_reader=HuggingFaceStorageReader(str(self.directory)))

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the directory, whole, by its name in the model, read alone from the
        safetensors file that holds it (or taken from the model transformers loaded, for files in
        another layout: `_converted_weights`)."""
        from safetensors import safe_open

        key = name.removeprefix(PREFIX)
        if key not in self._stored_keys:
            return self._converted_weights[key]
        file = self._weight_files[key] if self._weight_files is not None else "model.safetensors"
        with safe_open(str(self.directory / file), framework="pt") as weights:
            return weights.get_tensor(key)

    def _stored_under_the_models_names(self, part: nn.Module) -> bool:
        """Whether the files hold each of the part's parameters under one of the model's names
        (a tied weight under any of its own), so that each rank can read its slices alone."""
        return all(any(name.removeprefix(PREFIX) in self._stored_keys for name in names)
                   for names in names_of_each_parameter(part))

    @functools.cached_property
    def _stored_keys(self) -> set[str]:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return set(HuggingFaceStorageReader(str(self.directory)).read_metadata().state_dict_metadata)

    @functools.cached_property
    def _converted_weights(self) -> dict[str, torch.Tensor]:
        """Files in a layout of their own (Mixtral's keep each expert's projections apart; the model
        packs them into 3-D parameters): transformers converts them as it loads the model, whole,
        once in this process, and parts are copied from it."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32).state_dict()

    @functools.cached_property
    def _weight_files(self) -> dict[str, str] | None:
        """The directory's key -> safetensors file map, read once (None: one file holds all)."""
        index = self.directory / "model.safetensors.index.json"
        return json.loads(index.read_text())["weight_map"] if index.is_file() else None
