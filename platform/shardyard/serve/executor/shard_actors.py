"""The shard actors of a sharded model (serve/executor/shards.py), one per placement-group bundle.

Pipeline shards: shard i holds a contiguous run of blocks (the first also the embeddings, the last
the final norm and head), and a forward pass hands the hidden states from shard to shard; the last
returns the rows' picks. Tensor shards: every shard holds every block, but only its 1/N of each
attention and MLP linear (the model's tensor-parallel plan as training applies it,
parallel/tensor.py), over a process group of the shard actors; all run each pass together, and
rank 0 returns the picks.

Each reads only its part of a checkpoint (or of published weights), and can read another beside
the serving one (`prepare`), swap them and swap back: how a weight swap reaches every shard.
"""

from __future__ import annotations

from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardyard.checkpoint.published import Published, load_source_part
from shardyard.models.kv_cache import KVCache
from shardyard.parallel.tensor import apply_tensor_parallel
from shardyard.runtime import select_device
from shardyard.serve.executor.model_pass import Draws, Extra, model_output, run_model
from shardyard.serve.executor.model_thread import one_intra_op_thread
from shardyard.serve.executor.packed_linear import pack_linears
from shardyard.serve.executor.precision import cast_for_serving
from shardyard.serve.executor.staged_weights import StagedWeights
from shardyard.serve.sampling import Outcome

# A collective waiting on a dead peer gives up after this (gloo's default is 30 minutes).
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


class StagedShard:
    """A shard's weight swap (StagedWeights over its part of the model): the same calls for both
    kinds of shard."""
    weights: StagedWeights

    def prepare(self, source: str | Published) -> bool:
        """Reads this shard's part of another checkpoint (or of published weights) beside the one
        serving; whether it is finite. Pipeline shards read it while passes go on (a compiled
        graph's, on their own thread); tensor shards all at once, between passes, which wait."""
        return self.weights.prepare(source)

    def swap(self) -> None:
        self.weights.swap()

    def drop_staged(self) -> None:
        self.weights.drop()


@ray.remote
class PipelineShard(StagedShard):
    """Blocks [start, end) of the model in `checkpoint_dir` (the whole model when `whole`), on
    this actor's device."""

    def __init__(self, checkpoint_dir: str | Published, start: int, end: int, whole: bool, last: bool, use_gpu: bool,
                 cache_blocks: int, trust_factory: str | None = None, dtype: torch.dtype = torch.float32,
                 paged: bool = False) -> None:
        self.last = last  # its output is the logits (else hidden states for the next shard)
        self.device = select_device(0) if use_gpu else torch.device("cpu")
        self.whole, self.trust_factory, self.dtype = whole, trust_factory, dtype
        self.blocks = (start, end)
        self.weights = StagedWeights(self._load)
        self.weights.load(checkpoint_dir)
        # This shard's layers' keys and values (allocated at their first use).
        self.cache = KVCache(cache_blocks, paged=paged) if cache_blocks else None

    def _load(self, source: str | Published) -> torch.nn.Module:
        """Only this shard's blocks are read and held, never the whole model. With one intra-op
        thread: the passes run on another thread (a compiled graph's), whose OpenMP team stays the
        process's only one (serve/executor/model_thread.py)."""
        start, end = self.blocks
        with one_intra_op_thread():
            return pack_linears(load_source_part(
                source, lambda m: cast_for_serving(m if self.whole else m.pipeline_stage(start, end), self.dtype),
                self.device, trust_factory=self.trust_factory))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, extra: Extra, draws: Draws = None) -> torch.Tensor | list[Outcome]:
        extra = extra.to(self.device) if isinstance(extra, torch.Tensor) else extra
        out = run_model(self.weights.serving, x.to(self.device), extra, self.cache)
        return model_output(out, extra, draws) if self.last else out.cpu()

    def describe(self) -> dict:
        return {"blocks": self.blocks, "device": str(self.device),
                "parameters": sum(p.numel() for p in self.weights.serving.parameters())}


@ray.remote
class TensorShard(StagedShard):
    """Rank `rank` of `num_shards`: its slice of every block's linears, the small rest whole."""

    def __init__(self, checkpoint_dir: str | Published, rank: int, num_shards: int, use_gpu: bool, cache_blocks: int,
                 trust_factory: str | None = None, dtype: torch.dtype = torch.float32, paged: bool = False) -> None:
        self.checkpoint_dir, self.rank, self.num_shards = checkpoint_dir, rank, num_shards
        self.trust_factory, self.dtype = trust_factory, dtype
        self.device = select_device(0) if use_gpu else torch.device("cpu")
        self.weights = StagedWeights(self._load)
        # Keys and values of this rank's heads only.
        self.cache = KVCache(cache_blocks, paged=paged) if cache_blocks else None
        self.store: dist.TCPStore | None = None  # rank 0's, from host_rendezvous

    def host_rendezvous(self) -> tuple[str, int]:
        """Rank 0 hosts the shards' store, on a port the kernel gives it while binding (a port found
        free and handed on can be taken by another process first); where the other shards find it."""
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, self.num_shards, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        return host, self.store.port

    def join(self, host: str, port: int) -> None:
        """Form the shards' process group (every shard at once), then keep only this rank's slices:
        parallelize_module replaces each full weight by its shard, and the full one is freed."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        store = self.store if self.store is not None else dist.TCPStore(host, port, is_master=False,
                                                                         timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.num_shards,
                                timeout=COLLECTIVE_TIMEOUT)
        self.mesh = init_device_mesh(self.device.type, (self.num_shards,))
        self.weights.load(self.checkpoint_dir)

    def _load(self, source: str | Published) -> torch.nn.Module:
        """Sharded while empty, then each rank reads only its slices (every rank at once; published
        weights: each cuts its slices locally)."""
        return load_source_part(source, lambda m: apply_tensor_parallel(cast_for_serving(m, self.dtype), self.mesh),
                                self.device, collective=True, trust_factory=self.trust_factory)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, extra: Extra, draws: Draws = None) -> torch.Tensor | list[Outcome] | None:
        extra = extra.to(self.device) if isinstance(extra, torch.Tensor) else extra
        out = run_model(self.weights.serving, x.to(self.device), extra, self.cache)
        return model_output(out, extra, draws) if self.rank == 0 else None  # the same logits on every rank: one picks

    def describe(self) -> dict:
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                    for p in self.weights.serving.parameters())
        return {"rank": self.rank, "device": str(self.device), "parameters": local}
