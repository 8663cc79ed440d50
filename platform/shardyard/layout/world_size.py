"""A job spec at a world size: the (pp, dp, tp) mesh it runs as and the micro-batches per step
that keep the global batch exact. An elastic run, or one resumed at another size, lands on world
sizes its spec did not name: the mesh is re-planned when pp x tp no longer divides the size, and
the global batch changes only where the spec allows it.

The job spec's validation asks every world size a run may train at before any worker starts, so
a size nothing can run at is an error naming the key, not a failure mid-run. Specs are read
through their fields only: this module needs nothing from the spec module, which calls it.
"""

from __future__ import annotations

from typing import Any

from shardyard.layout.capabilities import pipeline_blocks


def grad_accum_steps(spec: Any, world_size: int) -> int | None:
    """Micro-batches per optimizer step on each data-parallel rank (the pipeline's
    n_microbatches) that keep the global batch exact, or None if none do."""
    dp = spec.parallelism.dp_size(world_size)
    per_pass = spec.batch.micro_batch_size * (dp or 0)
    if not per_pass or spec.batch.global_batch_size % per_pass:
        return None
    return spec.batch.global_batch_size // per_pass


def mesh_at(spec: Any, world_size: int) -> Any:
    """The parallelism section at `world_size`: the configured mesh while the size is a multiple
    of pp x tp (only the data-parallel degree changes); otherwise the most pipeline stages that
    divide it. Checkpoint keys are the full model's parameter names, so any re-plan loads them."""
    par = spec.parallelism
    if par.dp_size(world_size) is not None:
        return par
    # Asked once (a custom module is built to answer it); only a mesh of 3+ stages has smaller
    # pipelines to fall back to, and a validated pipeline spec's model can answer.
    blocks = pipeline_blocks(spec.model) if par.pp > 2 else 0
    for pp in range(par.pp - 1, 0, -1):
        if world_size % (pp * par.tp) or (pp > 1 and blocks < pp * par.stages_per_rank):
            continue
        fields: dict[str, Any] = {"pp": pp, "split_points": None}
        if pp == 1:  # no pipeline left: plain data parallel over the same ranks
            fields |= {"schedule": "1f1b", "stages_per_rank": 1,
                       "strategy": "ddp" if par.strategy == "pipeline" else par.strategy}
        return par.model_validate(par.model_dump() | fields)
    raise ValueError(f"world size {world_size} is not a multiple of parallelism.tp ({par.tp}): no mesh fits it")


def at_world_size(spec: Any, world_size: int) -> Any:
    """The spec as it runs at `world_size`: the mesh re-planned if it no longer fits and the
    global batch changed if the spec allows it; `spec` itself when nothing needs to change.
    ValueError, naming the keys, when nothing can run at this size."""
    par = mesh_at(spec, world_size)
    at_size = spec if par == spec.parallelism else spec.model_copy(update={"parallelism": par})
    accum = grad_accum_steps(at_size, world_size)
    per_pass = spec.batch.micro_batch_size * par.dp_size(world_size)
    if accum is None and spec.batch.allow_global_batch_change:
        accum = max(1, round(spec.batch.global_batch_size / per_pass))
        batch = spec.batch.model_copy(update={"global_batch_size": accum * per_pass})
        at_size = at_size.model_copy(update={"batch": batch})
    if accum is None:
        raise ValueError(
            f"batch.global_batch_size ({spec.batch.global_batch_size}) must be a multiple of "
            f"batch.micro_batch_size x data-parallel size; it is not for world size {world_size} "
            f"({spec.batch.micro_batch_size} x {par.dp_size(world_size)} = {per_pass}); set "
            f"batch.allow_global_batch_change=true to train with the nearest multiple instead")
    if par.pp > 1 and par.schedule != "gpipe" and accum < par.pp:
        raise ValueError(
            f"parallelism.schedule '{par.schedule}' needs at least parallelism.pp ({par.pp}) "
            f"micro-batches per step; batch.global_batch_size / (batch.micro_batch_size x "
            f"data-parallel size) is {accum} at world size {world_size}")
    return at_size
