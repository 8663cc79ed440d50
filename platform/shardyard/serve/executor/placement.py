"""Where shards run: one placement-group bundle (one device) per shard, inside a Serve replica's
own placement group or a new one, and a check, before anything waits, that the cluster has room.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Room the cluster has (check_room) but that others hold: wait this long for them to free it.
PLACEMENT_TIMEOUT_S = 120.0


@dataclass
class ShardPlacement:
    group: PlacementGroup
    first_bundle: int  # bundles before it belong to the caller (a Serve replica's own bundle)
    owned: bool        # created here (and so removed here), not the caller's


def shard_bundle(use_gpu: bool, cpus: float) -> dict[str, float]:
    """One shard's placement-group bundle: its CPU share, and on GPUs one GPU."""
    return {"GPU": 1.0, "CPU": cpus} if use_gpu else {"CPU": cpus}


def bundle_actor_options(bundle: dict[str, float], group: PlacementGroup, index: int) -> dict:
    """Options that run an actor in bundle `index` of `group` holding all of it. Without num_gpus
    Ray hides the bundle's GPU from the actor (CUDA_VISIBLE_DEVICES empty) and it falls back to
    the CPU; without num_cpus it asks 1 CPU to be scheduled, which a smaller bundle cannot give."""
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def check_room(bundles: list[dict[str, float]], multi_node: bool, what: str) -> None:
    """Fail fast, before a placement group waits forever: ValueError saying what `bundles` ask and
    what the cluster's live nodes have (one node for STRICT_PACK, all of them for PACK). Nodes an
    autoscaler has not started yet are not counted."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if multi_node:
        pools = [{key: sum(n.get(key, 0.0) for n in nodes) for key in need}]
    else:
        pools = [{key: n.get(key, 0.0) for key in need} for n in nodes]
    if any(all(pool[key] >= amount - 1e-9 for key, amount in need.items()) for pool in pools):
        return
    best = max(pools, key=lambda pool: sum(pool.values()), default={})
    where = "the cluster has" if multi_node else "its largest node has"
    raise ValueError(f"{what} asks for {_resources(need)} ({'PACK' if multi_node else 'STRICT_PACK'}); {where} "
                     f"{_resources(best)}: lower engine.num_shards or engine.cpus_per_shard, or add a node with more")


def _resources(amounts: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {key}" for key, amount in sorted(amounts.items())) or "nothing"


def place_shards(num_shards: int, bundle: dict[str, float], multi_node: bool = False,
                 timeout_s: float = PLACEMENT_TIMEOUT_S) -> ShardPlacement:
    """One bundle per shard: inside a Serve replica that asked for `1 + num_shards` bundles, its
    own placement group; otherwise a new one (STRICT_PACK on one node, PACK across nodes)."""
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= num_shards + 1:
        return ShardPlacement(current, len(current.bundle_specs) - num_shards, owned=False)
    check_room([bundle] * num_shards, multi_node, f"{num_shards} shards")
    group = placement_group([bundle] * num_shards, strategy="PACK" if multi_node else "STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        # A pending group is not forgotten: it would take the resources whenever they free up.
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the cluster has no room for {num_shards} shards of {bundle} "
                           f"({'PACK' if multi_node else 'STRICT_PACK'}) after {timeout_s:g} s") from None
    return ShardPlacement(group, 0, owned=True)


def uses_gpus(device: str, num_shards: int) -> bool:
    """Whether a replica's shards run on GPUs: `auto` when the cluster has one for each shard."""
    if device != "auto":
        return device == "cuda"
    if not ray.is_initialized():  # `serve run` builds the app before it connects
        from shardyard.cluster import address_to_join, join

        join(address_to_join())
    return ray.cluster_resources().get("GPU", 0) >= num_shards
