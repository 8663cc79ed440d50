"""DeepSpeed ZeRO stages 1, 2 and 3 through DeepSpeed's own engine.

Stage 1 shards optimizer state over the data-parallel ranks, stage 2 also gradients, stage 3
also parameters. The engine does its own gradient accumulation (it scales each micro-loss by
1/accumulation and steps only on the boundary), clipping and LR schedule stepping.
"""

from __future__ import annotations

import os
import tempfile
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardyard.parallel.engine import Engine, MicroBatch
from shardyard.runtime import autocast
from shardyard.spec import ZERO_STAGES, JobSpec

# DeepSpeed picks its accelerator at import: the CPU one (gloo, torch Adam) when there is no GPU.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
import deepspeed  # noqa: E402
from deepspeed.checkpoint import ds_to_universal  # noqa: E402
from deepspeed.checkpoint.constants import (  # noqa: E402
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)


# DeepSpeed's defaults, sized for billion-parameter models on GPUs.
DEFAULT_BUCKET = 500_000_000
DEFAULT_PERSISTENCE = 100_000


def zero_config(spec: JobSpec, accum_steps: int, device: torch.device, num_params: int,
                largest_param: int) -> dict:
    stage = ZERO_STAGES[spec.parallelism.strategy]
    zero: dict = {
        "stage": stage,
        # Communication buckets are allocated whole: never larger than the model itself.
        "reduce_bucket_size": min(DEFAULT_BUCKET, num_params),
        "allgather_bucket_size": min(DEFAULT_BUCKET, num_params),
        "stage3_prefetch_bucket_size": min(DEFAULT_BUCKET, num_params),
        # Stage 3 keeps tensors below this size whole on every rank; with the default a small
        # model's tensors would all stay whole and nothing would be sharded.
        "stage3_param_persistence_threshold": min(DEFAULT_PERSISTENCE, largest_param // 4),
    }
    if spec.parallelism.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": spec.batch.global_batch_size,
        "train_micro_batch_size_per_gpu": spec.batch.micro_batch_size,
        "gradient_accumulation_steps": accum_steps,
        "gradient_clipping": spec.optim.grad_clip,
        "zero_optimization": zero,
        # Our torch optimizer runs under ZeRO (DeepSpeed's fused CPU Adam would need a compiled op).
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": device.type == "cuda" and spec.run.precision != "fp32"},
        "steps_per_print": 1 << 30,
    }


class ZeroEngine(Engine):
    checkpoint_format = "deepspeed"

    @property
    def ds(self) -> "deepspeed.DeepSpeedEngine":
        return self.parts[0]

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            with autocast(self.device, self.amp_dtype):
                outputs = self.ds(inputs.to(self.device))
            loss = self.loss_fn(outputs, targets.to(self.device))
            self.ds.backward(loss)  # scaled by 1/accumulation inside
            self.ds.step()          # optimizer + LR step on the accumulation boundary only
            total += loss.detach() / len(micro_batches)
        return total

    def save_checkpoint(self, directory: Path, tag: str) -> None:
        # The universal-checkpoint marker is what lets DeepSpeed's converter reshard this
        # checkpoint later (stages 1 and 2 refuse to convert without it). A plain model has no
        # tensor-parallel slicing to describe, so the version is all it needs.
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        self.ds.save_checkpoint(str(directory), tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: info})

    def load_checkpoint(self, directory: Path, tag: str, resharded: bool) -> None:
        """Load a checkpoint; one written at another world size goes through DeepSpeed's universal
        format first (per-parameter fp32 weights and optimizer moments, no partitioning)."""
        if not resharded:
            self._load(directory, tag)
            return
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # One conversion per node, in node-local scratch space, removed once every rank has loaded.
        with tempfile.TemporaryDirectory(prefix="shardyard-universal-") as mine:
            everyones: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(everyones, mine)
            # Ray Train numbers ranks node by node, so the node's local rank 0 is rank - local_rank.
            scratch = Path(everyones[dist.get_rank() - local_rank])
            if local_rank == 0:
                ds_to_universal.main(Namespace(
                    input_folder=str(directory / tag), output_folder=str(scratch / "universal"),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                    inject_missing_state=False))
            dist.barrier()
            self._load(scratch, "universal", universal=True)
            dist.barrier()

    def _load(self, directory: Path, tag: str, universal: bool = False) -> None:
        # Read at load time by DeepSpeed's engine and ZeRO optimizer: restore from per-parameter
        # files and re-partition them for the ranks running now.
        self.ds._config.load_universal_checkpoint = universal
        loaded_from, _ = self.ds.load_checkpoint(str(directory), tag=tag)
        if loaded_from is None:  # DeepSpeed warns and carries on when it finds nothing
            raise FileNotFoundError(f"no ZeRO checkpoint under {directory / tag}")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, spec: JobSpec,
               accum_steps: int, device: torch.device) -> "deepspeed.DeepSpeedEngine":
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    sizes = [p.numel() for p in model.parameters()]
    config = zero_config(spec, accum_steps, device, sum(sizes), max(sizes))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=config)
    return engine
