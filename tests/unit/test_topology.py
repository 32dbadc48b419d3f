from __future__ import annotations

import pytest

from kvfold.topology import Topology


def test_partial_last_node_is_clamped() -> None:
    t = Topology(10, 4)
    assert t.num_nodes == 3  # ceil(10 / 4)
    assert [t.node_ranks(n) for n in range(3)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert [t.num_ranks_on(n) for n in range(3)] == [4, 4, 2]
    assert t.node_of(9) == 2


def test_from_mapping() -> None:
    t = Topology.from_mapping({0: 1, 1: 0, 2: 1, 3: 0})
    assert t.ranks_on(0) == (1, 3) and t.ranks_on(1) == (0, 2)
    assert t.node_of(2) == 1
    with pytest.raises(ValueError, match="non-contiguous"):
        t.node_ranks(0)
    assert Topology.from_mapping([0, 0, 1]).ranks_on(1) == (2,)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((0, 4), ValueError, "world_size must be >= 1, got 0"),
        ((4, 0), ValueError, "gpus_per_node must be >= 1, got 0"),
        ((4.0, 2), TypeError, "world_size must be an int"),
    ],
)
def test_bad_arguments(args, exc, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        Topology(*args)


def test_bad_rank_and_mapping() -> None:
    t = Topology(10, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 10\), got 10"):
        t.node_of(10)
    with pytest.raises(ValueError, match="node must be in"):
        t.ranks_on(3)
    with pytest.raises(ValueError, match="dense"):
        Topology.from_mapping({0: 0, 1: 2})
    with pytest.raises(ValueError, match="cover ranks"):
        Topology.from_mapping({0: 0, 2: 0})
