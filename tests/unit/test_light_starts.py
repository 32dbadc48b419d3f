"""What a starting process loads: the aggregator, node actors and CPU ranks start
without torch (1.5 s of CPU each here); a CPU rank's K/V bytes come at their first use
and are the same bytes as an eagerly built cache's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvfold.devices import gpu_device_present
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_config, toks

LIGHT = (
    "kvfold.aggregator.cluster_actor",
    "kvfold.aggregator.node_actor",
    "kvfold.worker.rank_actor",
    "kvfold.cluster.launcher",
    "kvfold.aggregator.client",
)


def loads_torch(code: str) -> bool:
    """Whether a fresh interpreter running `code` ends with torch loaded."""
    code += "\nimport sys\nprint('torch' in sys.modules)\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return res.stdout.split()[-1] == "True"


def test_the_actors_modules_load_no_torch() -> None:  # a GPU or not: nothing here asks it
    assert not loads_torch(f"import importlib\nfor m in {LIGHT!r}:\n    importlib.import_module(m)")


# Where a GPU is visible, a rank builds its storage at start (so it must load torch) and
# a host pool asks torch for pinned memory: what is light there is the modules (above).
@pytest.mark.skipif(
    gpu_device_present(), reason="a GPU is visible: ranks and host pools load torch by design"
)
def test_a_cpu_ranks_start_and_a_host_pool_load_no_torch() -> None:
    code = (
        "from kvfold.hosttier import HostTierServer\n"
        "from kvfold.worker import PagedKVCache, KVCacheConfig\n"
        "from kvfold.worker.storage_holder import storage_on_cpu\n"
        "config = KVCacheConfig(num_blocks=8)\n"
        "HostTierServer(4, config.block_layout())\n"
        "cache = PagedKVCache(config, storage_later=storage_on_cpu(config))\n"
        "assert cache.add_sequence('a', list(range(40)))\n"
        "assert not cache.storage_holder.built\n"
    )
    assert not loads_torch(code)


def test_storage_built_at_first_use_holds_the_same_bytes() -> None:
    eager = PagedKVCache(make_config(8))
    later = PagedKVCache(make_config(8), storage_later=True)
    assert eager.storage_holder.built and not later.storage_holder.built
    k = torch.randn(10, 2, 8, generator=torch.Generator().manual_seed(1))
    for cache in (eager, later):
        assert cache.add_sequence("a", toks(0, 10))
        assert cache is eager or not later.storage_holder.built  # accounting alone
        cache.write_kv("a", 0, list(range(10)), k, -k)
    assert later.storage_holder.built
    assert later.storage is later.storage  # built once
    for got, want in zip(later.gather_kv("a", 0), eager.gather_kv("a", 0), strict=True):
        assert torch.equal(got, want)
