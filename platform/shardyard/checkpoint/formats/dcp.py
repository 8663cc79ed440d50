"""The checkpoint format of every strategy but ZeRO: `torch.distributed.checkpoint` (DCP) shards,
keyed by the full model's parameter names whatever the strategy, so any checkpoint loads under any
strategy at any world size (DCP reshards by name). A ZeRO checkpoint loads into these engines
through whole per-parameter tensors (formats/zero.py)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardyard.checkpoint.collective import Written, barrier, node_scratch, storage_errors
from shardyard.checkpoint.dcp_io import checksummed_writer, read_dcp
from shardyard.layout.dcp_placements import dcp_layout
from shardyard.storage.store import RunStorage
from shardyard.checkpoint.formats.zero import state_field, write_whole, zero_full_state
from shardyard.parallel import Engine
from shardyard.spec import JobSpec

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_state(engine: Engine, load_optimizer: bool = True) -> list[tuple[dict, dict]]:
    parts = []
    for part, opt in zip(engine.parts, engine.optimizers):
        model_sd, optim_sd = get_state_dict(part, opt, options=_FLAT)
        parts.append((model_sd, optim_sd if load_optimizer else {}))
    return parts


def merged_state(parts: list[tuple[dict, dict]]) -> dict[str, Any]:
    """One flat dict over every model part: `model.<param>` and `optim.<flattened state key>`."""
    merged: dict[str, Any] = {}
    for model_sd, optim_sd in parts:
        merged.update({f"model.{k}": v for k, v in model_sd.items()})
        merged.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return merged


def set_parts(engine: Engine, parts: list[tuple[dict, dict]], merged: dict[str, Any]) -> None:
    for (model_sd, optim_sd), part, opt in zip(parts, engine.parts, engine.optimizers):
        model_state = {k: merged[f"model.{k}"] for k in model_sd}
        if not optim_sd:  # checkpoint.load_optimizer: false
            set_model_state_dict(part, model_state, options=_FLAT)
            continue
        set_state_dict(part, opt, options=_FLAT, model_state_dict=model_state,
                       optim_state_dict={k: merged[f"optim.{k}"] for k in optim_sd})


class DCPFormat:
    """Every strategy but ZeRO: DCP shards keyed by full parameter names."""

    name = "dcp"

    def save(self, engine: Engine, storage: RunStorage, name: str, group: dist.ProcessGroup | None) -> Written:
        """Every rank writes its shard (the coordinator also DCP's metadata), each file
        checksummed as it is written; asynchronous over `group`, when given."""
        url = storage.url(name)
        state = dcp_layout(merged_state(dcp_state(engine)))
        writer, files = checksummed_writer(url)
        if group is None:
            with storage_errors(url):
                dcp.save(state, storage_writer=writer)
            return Written(None, lambda: files)
        return Written(dcp.async_save(state, storage_writer=writer, process_group=group), lambda: files)

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None:
        if record["format"] != self.name:
            self._load_zero(engine, storage, name, record, stored, load_optimizer)
            return
        parts = dcp_state(engine, load_optimizer)
        merged = merged_state(parts)
        read_dcp(merged, storage.url(name), expected=record["files"])  # checksums checked as it reads
        set_parts(engine, parts, merged)

    @staticmethod
    def _load_zero(engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
                   load_optimizer: bool) -> None:
        """A ZeRO checkpoint into torch modules: its whole tensors are written once per node as a
        plain DCP checkpoint in scratch space, which every rank then loads like any other (DCP
        reshards it for FSDP, tensor and pipeline parts). The running optimizer keeps its settings."""
        parts = dcp_state(engine, load_optimizer)
        merged = merged_state(parts)
        fields = sorted({where[1] for key in merged if (where := state_field(key)) and where[1] != "param"})
        with zero_full_state(storage, name, stored, record["step"]) as full, node_scratch() as (scratch, leader):
            if leader:
                write_whole(full, stored, fields, scratch / "whole")
            barrier()
            tensors = {key: value for key, value in merged.items() if state_field(key) is not None}
            read_dcp(tensors, str(scratch / "whole"))
            barrier()  # before the leader's scratch space goes
        merged.update(tensors)
        set_parts(engine, parts, merged)


