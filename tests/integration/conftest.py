"""A local multi-node Ray cluster per test module (simulated GPUs), shared by its tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def wait_until(
    cond: Callable[[], object], timeout_s: float = 60.0, interval_s: float = 0.02
) -> object:
    """Poll `cond` until it returns something truthy; fail with the last value on timeout."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s (last: {last!r})")


@pytest.fixture(scope="module")
def local_cluster():  # type: ignore[no-untyped-def]
    from kvfold.cluster import start_local_cluster

    cluster = start_local_cluster(num_nodes=3, gpus_per_node=4)
    yield cluster
    cluster.shutdown()


@contextlib.contextmanager
def running(
    num_nodes: int, gpus_per_node: int, world_size: int, **launch_kwargs: Any
) -> Iterator[tuple[Any, Any]]:
    """A local cluster with kvfold launched on it, both stopped on the way out."""
    from kvfold.cluster import launch, start_local_cluster

    cluster = start_local_cluster(num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    try:
        deployment = launch(world_size, gpus_per_node, **launch_kwargs)
        try:
            yield cluster, deployment
        finally:
            deployment.shutdown()
    finally:
        cluster.shutdown()
