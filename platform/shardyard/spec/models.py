"""The model section: one of the model families, told apart by `name`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from shardyard.spec.base import Section, SpecError, read_from_storage
from shardyard.spec.factories import check_factory, load_factory


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

    # transformers' config, read once per source (path, config): the spec's checks, the planner and
    # every vocab_size lookup ask for it, and reading config.json each time cost them milliseconds.
    _read: tuple[tuple[str | None, str], Any] | None = PrivateAttr(default=None)

    def hf_config(self) -> Any:
        """The model's `transformers` config, a copy of its own for the caller to change (transformers
        sets attributes on the config it builds a model from)."""
        return copy.deepcopy(self._config())

    def _config(self) -> Any:
        source = (self.path, json.dumps(self.config, sort_keys=True, default=str))
        if self._read is None or self._read[0] != source:
            self._read = (source, self._read_config())
        return self._read[1]

    def _read_config(self) -> Any:
        from transformers import CONFIG_MAPPING, AutoConfig  # imported here: only Hugging Face specs need it

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
        return self._config().vocab_size

    @property
    def brings_tokenizer(self) -> bool:
        """A model directory with tokenizer files: text is tokenized with it, in training and serving."""
        return self.path is not None and any((Path(self.path) / name).is_file() for name in TOKENIZER_FILES)


class FactorySection(Section):
    """A model section whose module a function of the user's makes (`factory`, checked when the
    spec is validated). A section read from a checkpoint (checkpoint/layout.py) never calls it:
    code named by a file in a run directory runs only when the reader names it."""

    # Each kind declares `factory` itself, after its `name`, so that its keys read in that order.
    _from_storage: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _factory_exists(self, info: ValidationInfo) -> FactorySection:
        if not read_from_storage(info):  # a stored spec's factory is never imported
            check_factory("model.factory", self.factory)
        return self

    def _trusted_factory(self) -> Any:
        if self._from_storage:
            raise SpecError(f"model.factory '{self.factory}' is named by a spec stored in a run directory; it is "
                            f"imported only when the reader names it (--trust-factory, serving: trust_factory)")
        return load_factory(self.factory)


class CustomSpec(FactorySection):
    """The user's own `nn.Module`: `factory` returns it, given this section."""

    name: Literal["custom"] = "custom"
    factory: str = Field(description="'package.module:function'; called with this section, returns an "
                         "nn.Module mapping token ids (B, T) to logits (B, T, vocab_size)")
    block_size: int = Field(64, ge=2, description="training sequence length in tokens")
    vocab_size: int = Field(256, ge=2, description="256 for the byte-level corpus")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the factory as they are")

    def build(self) -> Any:
        """Call the factory (the models package checks what it returns)."""
        return self._trusted_factory()(self)


class ModuleSpec(FactorySection):
    """Any `nn.Module` of the user's, for a task of their own (an image classifier, a U-Net, ...):
    `factory(**options)` returns it. It is called on each batch the data section's collation
    makes: on its first element when the batch is a tuple or list (inputs, targets, ...), else on
    the whole batch; `loss.factory` turns its output and the batch into the loss."""

    name: Literal["module"] = "module"
    factory: str = Field(description="'package.module:function'; called with `options` as keyword arguments, "
                         "returns the nn.Module")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")

    def build(self) -> Any:
        return self._trusted_factory()(**self.options)


ModelSpec = Annotated[Union[GPTSpec, MLPSpec, HFSpec, CustomSpec, ModuleSpec], Field(discriminator="name")]
# Models whose factory is the user's code: a spec read back from a run never runs it unasked.
FACTORY_MODELS = (CustomSpec, ModuleSpec)  # FactorySection's kinds
# Models that read token ids and predict the next one: the corpus and token data feed them.
LANGUAGE_MODELS = (GPTSpec, HFSpec, CustomSpec)
