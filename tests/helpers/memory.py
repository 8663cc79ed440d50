"""Per-rank memory of parameters, gradients and optimizer state, measured by walking every live
tensor just before an optimizer step (benchmarks/memory.py says how, and what it finds), for a
small GPT under any strategy."""

from __future__ import annotations

import gc
import resource

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.layout.world_size import grad_accum_steps
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import parse_spec


def job(strategy: str, world: int) -> dict:
    return {"model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 32},
            "data": {"name": "synthetic", "num_samples": 512},
            "optim": {"grad_clip": 0.0},
            "batch": {"global_batch_size": 8, "micro_batch_size": 8 // world},
            "parallelism": {"strategy": strategy}, "scaling": {"num_workers": world}}


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if isinstance(t, DTensor):
        t = t.to_local()
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


def _storages(tensors) -> dict[int, int]:
    return dict(filter(None, (_storage(t) for t in tensors)))


def measure(rank: int, world: int, raw: dict) -> dict:
    spec = parse_spec(raw)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), 0)
    accum = grad_accum_steps(spec, world)
    batch = lambda step: [dataset.batch(i) for i in micro_batch_ids(  # noqa: E731
        order, step * spec.batch.global_batch_size, engine.dp_rank, engine.dp_size,
        spec.batch.micro_batch_size, accum)]
    engine.train_step(batch(0))  # optimizer state now exists

    ds = getattr(engine, "ds", None)  # ZeRO engines wrap DeepSpeed's
    if ds is not None:
        for x, y in batch(1):
            ds.backward(engine.loss_fn(ds(x), y))
        zero_opt = ds.optimizer
        params = [getattr(p, "ds_tensor", p) for p in ds.module.parameters()]
        masters = (getattr(zero_opt, "single_partition_of_fp32_groups", None)
                   or getattr(zero_opt, "fp32_partitioned_groups_flat", []))
        torch_opt = zero_opt.optimizer
    else:
        engine.forward_backward(batch(1))
        params = engine.parameters()
        masters, torch_opt = [], engine.optimizers[0]

    param_bytes = _storages(params)
    optim_bytes = _storages([v for s in torch_opt.state.values() for v in s.values() if torch.is_tensor(v)]
                            + list(masters))
    optim_bytes = {k: v for k, v in optim_bytes.items() if k not in param_bytes}
    gc.collect()
    # .grad wrappers exist in Python only once accessed: take them explicitly, then the rest.
    grads = [p.grad for p in params if p.grad is not None]
    live = _storages([*grads, *(o for o in gc.get_objects() if torch.is_tensor(o))])
    data = _storages([t for mb in batch(1) for t in mb])
    grad_bytes = {k: v for k, v in live.items() if k not in param_bytes and k not in optim_bytes and k not in data}
    psi = sum(p.numel() for p in build_model(spec.model).parameters())
    dist.barrier()
    return {"params": sum(param_bytes.values()), "grads": sum(grad_bytes.values()),
            "optim": sum(optim_bytes.values()), "psi": psi,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
