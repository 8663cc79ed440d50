"""A GPT too large for one device, split across shard actors: one placement-group bundle (one
device) per shard, each shard holding only its part of the weights.

Pipeline mode: shard i holds a contiguous run of blocks (the first also the embeddings, the last
the final norm and head, split balanced by parameters as in training), and a forward pass hands
the hidden states from shard to shard as Ray object references: Ray moves each activation
straight from one shard's process to the next, never through the caller.

Any training checkpoint loads here, whatever strategy wrote it (checkpoint.load_model).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardyard.models.gpt import GPT
from shardyard.parallel.pipeline import balanced_split, carve_stage
from shardyard.runtime import select_device
from shardyard.spec import GPTSpec
from shardyard.train.checkpoint import load_model, read_spec


@ray.remote
class ModelShard:
    """Blocks [start, end) of the GPT in `checkpoint_dir`, on this actor's device."""

    def __init__(self, checkpoint_dir: str, start: int, end: int, use_gpu: bool) -> None:
        full = load_model(checkpoint_dir)  # read on the host once; only this shard's part stays
        self.device = select_device(0) if use_gpu else torch.device("cpu")
        self.stage = carve_stage(full, start, end).to(self.device).eval()
        del full
        self.blocks = (start, end)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        out = self.stage(x.to(self.device), None if pad is None else pad.to(self.device))
        return out.cpu()

    def describe(self) -> dict:
        return {"blocks": self.blocks, "device": str(self.device),
                "parameters": sum(p.numel() for p in self.stage.parameters())}


@dataclass
class ShardPlacement:
    group: PlacementGroup
    first_bundle: int  # bundles before it belong to the caller (a Serve replica's own bundle)
    owned: bool        # created here (and so removed here), not the caller's


def place_shards(num_shards: int, use_gpu: bool, multi_node: bool = False) -> ShardPlacement:
    """One bundle per shard: inside a Serve replica that asked for `1 + num_shards` bundles, its
    own placement group; otherwise a new one (STRICT_PACK on one node, PACK across nodes)."""
    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= num_shards + 1:
        return ShardPlacement(current, len(current.bundle_specs) - num_shards, owned=False)
    group = placement_group([bundle] * num_shards, strategy="PACK" if multi_node else "STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    return ShardPlacement(group, 0, owned=True)


class ShardedGPT:
    """The caller's handle on a group of pipeline shards; rebuilds the group when a shard dies."""

    def __init__(self, checkpoint_dir: str, num_shards: int, use_gpu: bool = False,
                 multi_node: bool = False) -> None:
        self.checkpoint_dir, self.num_shards, self.use_gpu = checkpoint_dir, num_shards, use_gpu
        self.multi_node = multi_node
        spec = read_spec(checkpoint_dir).model
        if not isinstance(spec, GPTSpec):
            raise ValueError(f"{checkpoint_dir} holds a '{spec.name}' model; sharded serving is for the GPT")
        if num_shards > spec.n_layer:
            raise ValueError(f"cannot split {spec.n_layer} blocks into {num_shards} shards")
        self.block_size = spec.block_size
        with torch.device("meta"):  # the model's shape only, no weights: to plan the split
            skeleton = GPT(spec)
        points = balanced_split(skeleton, num_shards) if num_shards > 1 else []
        self.ranges = list(zip([0, *points], [*points, spec.n_layer]))
        self.placement = place_shards(num_shards, use_gpu, multi_node)
        self.shards: list = []
        self.rebuilds = 0
        self._start_shards()

    def _start_shards(self) -> None:
        p = self.placement
        self.shards = [
            ModelShard.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                p.group, placement_group_bundle_index=p.first_bundle + i)).remote(
                self.checkpoint_dir, start, end, self.use_gpu)
            for i, (start, end) in enumerate(self.ranges)
        ]
        ray.get([s.describe.remote() for s in self.shards])  # loaded and ready

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            ray.get([s.describe.remote() for s in self.shards], timeout=timeout_s)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def rebuild(self) -> None:
        """Replace every shard (a dead one's part must be reloaded; the rest restart with it so
        no half-old group serves)."""
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.rebuilds += 1
        self._start_shards()

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the whole model: each shard's output goes to the next as a Ray reference."""
        ref = tokens
        for shard in self.shards:
            ref = shard.forward.remote(ref, pad)
        return ray.get(ref)

    def close(self) -> None:
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        if self.placement.owned:
            ray.util.remove_placement_group(self.placement.group)

