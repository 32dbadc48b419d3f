"""How a view is shown: JSON, the table, and the Prometheus families (no Ray)."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.display import render_table, view_to_dict
from kvfold.metrics import ViewCollector
from kvfold.stats import HostStats
from kvfold.topology import Topology
from kvfold.view import SourceState
from tests.unit.builders import make_report


def sample_view():  # type: ignore[no-untyped-def]
    topo = Topology(6, 4)  # nodes of 4 and 2 ranks
    views = {
        n: fold_node(
            topo,
            n,
            {r: make_report(r, used=r, reused=1, missed=2) for r in topo.ranks_on(n)},
            HostStats(10, n),
        )
        for n in range(2)
    }
    return fold_cluster(topo, views, {1: SourceState.STALE}, version=7)


def test_json_and_table() -> None:
    view = sample_view()
    d = json.loads(json.dumps(view_to_dict(view)))
    assert d["version"] == 7 and d["stale_nodes"] == [1] and d["stale_ranks"] == [4, 5]
    assert [n["num_ranks_expected"] for n in d["nodes"]] == [4, 2]
    assert d["totals"]["gpu"]["num_blocks_used"] == 0 + 1 + 2 + 3  # node 1 is stale: excluded
    table = render_table(view)
    assert "stale" in table and "cluster v7" in table and "stale ranks [4, 5]" in table


def test_prometheus_families_match_the_view() -> None:
    view = sample_view()
    registry = CollectorRegistry(auto_describe=False)
    refused = {("node", "bad_msgpack"): 3}
    decisions = {("admit", "fits"): 5}
    registry.register(ViewCollector(lambda: view, lambda: refused, lambda: decisions))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert (
        samples[("kvfold_gpu_blocks", (("node", "0"), ("state", "used"), ("window", "full")))] == 6
    )
    assert samples[("kvfold_node_state", (("node", "1"), ("state", "stale")))] == 1
    # the cluster gauge counts fresh capacity only; the stale node's numbers stay visible per node
    assert samples[("kvfold_cluster_gpu_blocks", (("state", "used"), ("window", "full")))] == 6
    assert (
        samples[("kvfold_gpu_blocks", (("node", "1"), ("state", "used"), ("window", "full")))] == 9
    )
    assert (
        samples[("kvfold_blocks_total", (("kind", "reused"), ("node", "0"), ("window", "full")))]
        == 4
    )
    assert (
        samples[("kvfold_reports_refused_total", (("reason", "bad_msgpack"), ("source", "node")))]
        == 3
    )
    assert (
        samples[("kvfold_admission_decisions_total", (("outcome", "admit"), ("reason", "fits")))]
        == 5
    )
    assert samples[("kvfold_host_blocks", (("node", "1"), ("state", "used")))] == 1
    assert samples[("kvfold_view_version", ())] == 7
