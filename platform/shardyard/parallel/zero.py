"""DeepSpeed ZeRO stages 1, 2 and 3 through DeepSpeed's own engine.

Stage 1 shards optimizer state over the data-parallel ranks, stage 2 also gradients, stage 3
also parameters. The engine does its own gradient accumulation (it scales each micro-loss by
1/accumulation and steps only on the boundary), clipping and LR schedule stepping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from shardyard.models import new_model
from shardyard.models.initial_weights import InitialWeights, initial_values
from shardyard.parallel.engine import Engine, MicroBatch, to_device
from shardyard.parallel.deepspeed_ops import ensure_deepspeed_ops
from shardyard.runtime import autocast, import_deepspeed
from shardyard.spec import ZERO_STAGES, JobSpec

if TYPE_CHECKING:
    import deepspeed


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
        # DeepSpeed has tested ZeRO with its own Adam variants only and refuses others unless told;
        # ZeRO partitions any element-wise torch optimizer correctly (SGD is tested here against
        # the single-process oracle).
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": device.type == "cuda" and spec.run.precision != "fp32"},
        "steps_per_print": 1 << 30,
    }


class ZeroEngine(Engine):
    checkpoint_format = "deepspeed"  # DeepSpeed's own files (checkpoint/formats/zero.py)

    @property
    def ds(self) -> "deepspeed.DeepSpeedEngine":
        return self.parts[0]

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 partitions the parameters themselves: each is gathered whole for the copy
        (stages 1 and 2 keep them whole on every rank, and gathering them is a no-op)."""
        with import_deepspeed().zero.GatheredParameters(list(self.module.parameters())):
            if dist.get_rank() != 0:
                return {}
            return {name: t.detach().to("cpu", copy=True) for name, t in self.module.state_dict().items()}

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            with autocast(self.device, self.amp_dtype):
                outputs = self.ds(to_device(inputs, self.device))
            loss = self.loss_fn(outputs, to_device(targets, self.device))
            self.ds.backward(loss)  # scaled by 1/accumulation inside
            self.ds.step()          # optimizer + LR step on the accumulation boundary only
            total += loss.detach() / len(micro_batches)
        norm = self.ds.get_global_grad_norm()  # DeepSpeed's own, measured as it stepped
        self.grad_norm = None if norm is None else torch.as_tensor(float(norm))
        return total


def _config_for(model: nn.Module, spec: JobSpec, accum_steps: int, device: torch.device) -> dict:
    # A parameter that ZeRO-3 has partitioned keeps its whole size in ds_numel (its own is empty).
    sizes = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
    return zero_config(spec, accum_steps, device, sum(sizes), max(sizes))


def start(device: torch.device) -> None:
    """Once per engine, before `build_partitioned` and `initialize`: DeepSpeed's op and its view
    of the process group."""
    deepspeed = import_deepspeed()
    ensure_deepspeed_ops()  # never wait on a build lock that a killed process left behind
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def build_partitioned(spec: JobSpec, shapes: nn.Module, accum_steps: int, device: torch.device,
                      weights: InitialWeights | None = None) -> nn.Module:
    """ZeRO-3 without the whole model on any rank: built under DeepSpeed's `zero.Init` (each
    module's parameters partitioned over the ranks as soon as the module exists), then each unit
    (a decoder layer, an embedding: models/initial_weights.py) gathered in turn, filled by rank 0
    from `weights` (a model directory's) or from the unit drawn at random, and partitioned again.
    `shapes`: the model on the meta device (models.build_for_job)."""
    deepspeed = import_deepspeed()
    # The constructor's own random init is overwritten below: kept off the caller's generator,
    # which then goes on (dropout) as it would after any other strategy's build.
    with torch.random.fork_rng(devices=[]), \
            deepspeed.zero.Init(config_dict_or_path=_config_for(shapes, spec, accum_steps, device)):
        model = new_model(spec.model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for values in initial_values(shapes, wanted=set(params), weights=weights):
        with deepspeed.zero.GatheredParameters([params[name] for name in values], modifier_rank=0):
            if dist.get_rank() == 0:
                for name, value in values.items():
                    params[name].data.copy_(value)
    return model


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, spec: JobSpec,
               accum_steps: int, device: torch.device) -> "deepspeed.DeepSpeedEngine":
    config = _config_for(model, spec, accum_steps, device)
    engine, _, _, _ = import_deepspeed().initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=config)
    return engine
