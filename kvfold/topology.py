"""Ranks to nodes, with a partial last node clamped to the world size.

    world_size=10, gpus_per_node=4

    node 0: ranks 0 1 2 3
    node 1: ranks 4 5 6 7
    node 2: ranks 8 9          <- expects 2 ranks, never 4

A topology can also be built from an explicit rank -> node mapping (where Ray
actually placed each rank), for heterogeneous clusters. Pure; no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfold.checks import check_index, check_int


@dataclass(frozen=True, slots=True)
class Topology:
    """Which node holds which rank.

    Nodes are numbered 0..num_nodes-1 and each holds a contiguous or explicit
    set of ranks. `gpus_per_node` is the nominal node size; `node_ranks(n)` is
    what node n really holds (clamped for the last node).
    """

    world_size: int
    gpus_per_node: int
    _rank_to_node: tuple[int, ...] = field(default=(), repr=False, compare=True)
    _node_to_ranks: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("gpus_per_node", self.gpus_per_node, 1)
        if not self._rank_to_node:
            g = self.gpus_per_node
            object.__setattr__(self, "_rank_to_node", tuple(r // g for r in range(self.world_size)))
        if len(self._rank_to_node) != self.world_size:
            raise ValueError(
                f"rank_to_node has {len(self._rank_to_node)} entries, world_size is "
                f"{self.world_size}"
            )
        num_nodes = max(self._rank_to_node) + 1
        groups: list[list[int]] = [[] for _ in range(num_nodes)]
        for rank, node in enumerate(self._rank_to_node):
            groups[node].append(rank)
        object.__setattr__(self, "_node_to_ranks", tuple(tuple(g) for g in groups))

    @classmethod
    def from_mapping(cls, rank_to_node: Mapping[int, int] | Sequence[int]) -> Topology:
        """Build from where ranks really are: `{rank: node}` or a list indexed by rank.

        Ranks must be exactly 0..N-1; nodes must be 0..M-1 with every node
        holding at least one rank (node ids are dense so they index arrays).
        """
        if isinstance(rank_to_node, Mapping):
            ranks = sorted(rank_to_node)
            if ranks != list(range(len(ranks))):
                raise ValueError(f"rank_to_node must cover ranks 0..N-1 exactly, got {ranks}")
            nodes = [rank_to_node[r] for r in ranks]
        else:
            nodes = list(rank_to_node)
        if not nodes:
            raise ValueError("rank_to_node must hold at least one rank, got none")
        for rank, node in enumerate(nodes):
            check_int(f"rank_to_node[{rank}]", node, 0)
        used = sorted(set(nodes))
        if used != list(range(len(used))):
            raise ValueError(f"node ids must be dense 0..M-1, got {used}")
        largest = max(nodes.count(n) for n in used)
        return cls(len(nodes), largest, tuple(nodes))

    @property
    def num_nodes(self) -> int:
        return len(self._node_to_ranks)

    def node_of(self, rank: int) -> int:
        """The node holding `rank`; ValueError for a rank outside the world."""
        self.check_rank(rank)
        return self._rank_to_node[rank]

    def check_rank(self, rank: int) -> None:
        check_index("rank", rank, self.world_size)

    def check_node(self, node: int) -> None:
        check_index("node", node, self.num_nodes)

    def ranks_on(self, node: int) -> tuple[int, ...]:
        """Every rank on `node`, for contiguous and explicit topologies alike."""
        self.check_node(node)
        return self._node_to_ranks[node]

    def node_ranks(self, node: int) -> range:
        """The contiguous rank range of `node`, clamped to the world size.

        For an explicit mapping whose node is not contiguous, use `ranks_on`.
        """
        ranks = self.ranks_on(node)
        span = range(ranks[0], ranks[-1] + 1)
        if len(span) != len(ranks):
            raise ValueError(f"node {node} holds non-contiguous ranks {ranks}; use ranks_on")
        return span

    def num_ranks_on(self, node: int) -> int:
        return len(self.ranks_on(node))

    def as_list(self) -> list[int]:
        """rank -> node as a plain list (what travels on the wire)."""
        return list(self._rank_to_node)
