"""Where kvfold goes on a Ray cluster: one GPU bundle per rank (PACK), the ranks numbered
node by node (fullest nodes first, so the partial node is last), and the head node for
what must outlive a worker node. A placement that cannot be satisfied fails in time,
naming what is missing, and leaves nothing behind. Used by kvfold.cluster.launcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from kvfold.cluster.settings import LaunchSettings
from kvfold.errors import PlacementError
from kvfold.naming import PLACEMENT_GROUP_NAME


def missing_resources(world_size: int, gpus_per_rank: float) -> str:
    total = ray.cluster_resources().get("GPU", 0.0)
    free = ray.available_resources().get("GPU", 0.0)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    need = world_size * gpus_per_rank
    return (
        f"asked for {world_size} ranks x {gpus_per_rank:g} GPU = {need:g} GPU; the cluster has "
        f"{total:g} GPU in all on {len(alive)} nodes, {free:g} free; missing "
        f"{max(0.0, need - free):g} GPU. Add GPU nodes, lower --world-size, or stop what holds them"
    )


def assign_ranks(
    bundle_nodes: Sequence[str], node_order: Sequence[str]
) -> tuple[list[int], list[str], list[int]]:
    """Bundles -> (bundle index of each rank, Ray node id of each kvfold node, rank -> node).

    Nodes holding more bundles come first (so a partial node is last); ties keep
    Ray's node order. Ranks are contiguous on each node.
    """
    counts: dict[str, list[int]] = {}
    for b, nid in enumerate(bundle_nodes):
        counts.setdefault(nid, []).append(b)
    order = sorted(
        counts,
        key=lambda nid: (-len(counts[nid]), node_order.index(nid) if nid in node_order else 0),
    )
    rank_bundle: list[int] = []
    rank_to_node: list[int] = []
    for node, nid in enumerate(order):
        for b in counts[nid]:
            rank_bundle.append(b)
            rank_to_node.append(node)
    return rank_bundle, order, rank_to_node


@dataclass(frozen=True)
class Placement:
    """Where Ray put kvfold: the placement group, each rank's bundle, each node's Ray id."""

    group: Any
    rank_bundle: list[int]
    node_ids: list[str]
    rank_to_node: list[int]


def place(settings: LaunchSettings) -> Placement:
    """Reserve one GPU bundle per rank (PACK) and number the ranks node by node; fail in
    time, naming what is missing, and leave nothing behind."""
    world, gpus = settings.world_size, settings.gpus_per_rank
    pg = placement_group(
        [{"GPU": gpus}] * world,
        strategy="PACK",
        name=PLACEMENT_GROUP_NAME if settings.detached else "",
        lifetime="detached" if settings.detached else None,
    )
    timeout = settings.placement_timeout_s
    if not pg.wait(timeout_seconds=timeout):
        message = missing_resources(world, gpus)
        remove_placement_group(pg)
        raise PlacementError(f"could not place kvfold within {timeout:g} s: {message}")
    table = ray.util.placement_group_table(pg)
    bundle_nodes = [table["bundles_to_node_id"][b] for b in range(world)]
    ray_order = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    rank_bundle, node_ids, rank_to_node = assign_ranks(bundle_nodes, ray_order)
    return Placement(pg, rank_bundle, node_ids, rank_to_node)


HEAD_RESOURCE = "node:__internal_head__"


def on_head_node() -> dict[str, float]:
    """Resources that pin an actor (the aggregator, the racks) to the head node, as Ray
    Serve pins its controller: losing a worker node must not take the cluster's view with
    it (docs/decisions.md)."""
    return {HEAD_RESOURCE: 0.001} if HEAD_RESOURCE in ray.cluster_resources() else {}


__all__ = [
    "HEAD_RESOURCE",
    "Placement",
    "assign_ranks",
    "missing_resources",
    "on_head_node",
    "place",
]
