"""Reading checkpoints in one process, with no process group of training's: what serving and
export load. Every read goes through the commit record: a run directory resolves to its newest
good checkpoint (a bad one is named in a warning and passed over), and a checkpoint named
directly is refused, naming what is wrong, if its files do not match their record."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardyard.checkpoint.collective import single_process_io
from shardyard.checkpoint.dcp_io import read_dcp
from shardyard.checkpoint.layout import is_hf_directory, read_spec, trusted
from shardyard.checkpoint.pretrained import PretrainedWeights
from shardyard.checkpoint.record import BadCheckpoint, newest_good, read_record, verify
from shardyard.storage.store import RunStorage
from shardyard.checkpoint.formats.zero import DeepSpeedFormat, local_zero_files, parameter_names
from shardyard.models import build_model, give_storage, materialise
from shardyard.models.initial_weights import copy_local
from shardyard.runtime import import_deepspeed
from shardyard.spec import CustomSpec, JobSpec

ZERO_FORMAT = DeepSpeedFormat.name


def _split(checkpoint_dir: Path) -> tuple[RunStorage, str]:
    return RunStorage(checkpoint_dir.parent), checkpoint_dir.name


def committed_record(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The commit record of a checkpoint directory; None if it has none or it is not valid."""
    try:
        return read_record(*_split(Path(checkpoint_dir).absolute()))
    except (BadCheckpoint, ValueError):
        return None


def checked_record(checkpoint_dir: Path, verify_files: bool) -> dict[str, Any]:
    """The record of a checkpoint about to be read; BadCheckpoint when it is not committed, its
    record is bad, or (`verify_files`) a file does not match it."""
    storage, name = _split(checkpoint_dir.absolute())
    try:
        record = read_record(storage, name)
    except ValueError:  # not a checkpoint's name
        record = None
    if record is None:
        raise BadCheckpoint(f"{checkpoint_dir} is not a committed checkpoint")
    if verify_files:
        verify(storage, name, record)
    return record


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest good checkpoint of a run in a local or shared directory."""
    run_dir = Path(run_dir).absolute()
    found = newest_good(RunStorage(run_dir))
    return run_dir / found[0] if found else None


def servable(path: str | Path) -> Path | None:
    """What serving and export load from `path` now, verified: a checkpoint or a Hugging Face
    model directory as given, or a run directory's newest good checkpoint (None when it has none
    yet). Raises BadCheckpoint for a checkpoint named directly that is not good."""
    given = Path(path).expanduser().resolve()
    if is_hf_directory(given):
        return given
    if (given / "COMMITTED").exists() or given.name.startswith("checkpoint_step_"):
        checked_record(given, verify_files=True)
        return given
    return find_latest(given) if given.is_dir() else None


def load_model(checkpoint_dir: str | Path, trust_factory: str | None = None, verify: bool = True) -> nn.Module:
    """Rebuild the trained model in one process from any committed checkpoint, whatever strategy
    and world size wrote it (DCP reads every shard itself). Its files are checked against the
    commit record first (`verify`; False where `servable` just did)."""
    checkpoint_dir = Path(checkpoint_dir)
    if is_hf_directory(checkpoint_dir):
        return build_model(read_spec(checkpoint_dir).model, PretrainedWeights(checkpoint_dir))
    record = checked_record(checkpoint_dir, verify)
    stored = trusted(read_spec(checkpoint_dir), str(checkpoint_dir), trust_factory)
    model = build_model(stored.model)  # weights: the checkpoint's
    if record["format"] == ZERO_FORMAT:
        import_deepspeed()  # its accelerator chosen before any of its modules load
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with local_zero_files(*_split(checkpoint_dir.absolute())) as zero:  # the checked bytes, not the live files
            state = get_fp32_state_dict_from_zero_checkpoint(str(zero.parent), tag=zero.name)
        # DeepSpeed saves a tied weight once, under one of its names; any other gap is an error.
        every = dict(model.named_parameters(remove_duplicate=False))
        aliases = set(every) - set(dict(model.named_parameters()))
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - aliases:
            raise KeyError(f"ZeRO checkpoint {checkpoint_dir} does not match the model: missing "
                           f"{sorted(set(result.missing_keys) - aliases)}, unexpected {result.unexpected_keys}")
        return model
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    with single_process_io():  # each file checked as read against the record judged above
        read_dcp(state, checkpoint_dir, no_dist=True, expected=record["files"])
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model


def load_model_part(checkpoint_dir: str | Path, part: Callable[[nn.Module], nn.Module], device: torch.device,
                    collective: bool = False, trust_factory: str | None = None) -> nn.Module:
    """What `part` makes of a checkpoint's model (a pipeline stage, the model sharded for tensor
    parallelism), reading only that part's tensors or slices: the model is built on the meta
    device, `part` taken from it, given storage on `device`, and the checkpoint (DCP) or the
    model directory (its safetensors) fills it. `collective`: every rank of the current process
    group loads its own part at once (tensor-parallel slices). A ZeRO checkpoint is read through
    DeepSpeed's converter in its lazy mode (`_fill_from_zero`). A custom module (its buffers are
    unknown here) loads whole first. The caller has verified the checkpoint (`servable`)."""
    checkpoint_dir = Path(checkpoint_dir)
    stored = trusted(read_spec(checkpoint_dir), str(checkpoint_dir), trust_factory)
    spec = stored.model
    hf_directory = is_hf_directory(checkpoint_dir)
    record = None if hf_directory else checked_record(checkpoint_dir, verify_files=False)
    if isinstance(spec, CustomSpec):
        return part(load_model(checkpoint_dir, trust_factory, verify=False).to(device))
    with torch.device("meta"):  # shapes; a model directory's weights are read once split
        piece = part(build_model(spec))
    if hf_directory:
        return materialise(piece, device, weights=PretrainedWeights(checkpoint_dir))
    give_storage(piece, device)
    if record["format"] == ZERO_FORMAT:
        _fill_from_zero(piece, checkpoint_dir, stored)
        return piece
    state = {f"model.{k}": v for k, v in piece.state_dict().items()}
    # Each file is checked as it is read against the record read above: a file swapped after
    # `servable` verified the checkpoint is refused, not served.
    if collective:
        read_dcp(state, checkpoint_dir, expected=record["files"])
    else:
        with single_process_io():
            read_dcp(state, checkpoint_dir, no_dist=True, expected=record["files"])
    piece.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return piece


def _fill_from_zero(piece: nn.Module, checkpoint_dir: Path, stored: JobSpec) -> None:
    """Each tensor `piece` holds (its slice, when sharded) from a ZeRO checkpoint, through
    DeepSpeed's converter in lazy mode: it maps the ranks' partition files, and a ZeRO-3
    checkpoint's parameters are gathered one at a time, only those asked for. (ZeRO-1/2 files
    hold flat groups the converter joins whole: those weights pass through host memory once; the
    model held them whole on every training rank too.)"""
    import_deepspeed()  # its accelerator chosen before any of its modules load
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    aliases = parameter_names(stored)  # DeepSpeed saves a tied weight once, under one of its names
    # DeepSpeed unpickles its files unrestricted: it reads a private copy that was checked, never
    # the run's live files, which a writer of the run could swap after a check.
    with local_zero_files(*_split(checkpoint_dir.absolute())) as zero:
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(zero.parent), tag=zero.name, lazy_mode=True)
        for name, target in piece.state_dict(keep_vars=True).items():
            saved_as = next((n for n in aliases.get(name, [name]) if n in lazy), None)
            if saved_as is None:
                raise KeyError(f"ZeRO checkpoint {checkpoint_dir} holds no '{name}'")
            copy_local(target, lazy[saved_as].contiguous())


def export_safetensors(checkpoint_dir: str | Path, out: str | Path, trust_factory: str | None = None) -> Path:
    """One plain state_dict file from a checkpoint of any strategy, loadable in one process."""
    from safetensors.torch import save_model

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(load_model(checkpoint_dir, trust_factory), str(out))  # save_model handles tied weights
    return out
