"""A field a rank's source does not publish (an engine's cached and committed blocks, its
per-iteration counters) travels as unknown and is shown as unknown: in the fold, the
JSON, the table, Prometheus and admission; never read as 0."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome
from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.codec import (
    decode_node_report,
    decode_rank_report,
    encode_node_report,
    encode_rank_report,
)
from kvfold.display import render_table, view_to_dict
from kvfold.errors import ReportError
from kvfold.metrics import ViewCollector
from kvfold.topology import Topology
from kvfold.view import ClusterView
from tests.unit.builders import make_report

TOPO = Topology(4, 2)
ENGINE = frozenset({"cached", "committed", "deltas"})


def view_with_engines(engine_ranks: set[int]) -> ClusterView:
    nodes = {}
    for n in range(TOPO.num_nodes):
        reports = {}
        for r in TOPO.ranks_on(n):
            rep = make_report(r, used=2, total=16, cached=5)
            reports[r] = replace(rep, unknown=ENGINE) if r in engine_ranks else rep
        nodes[n] = fold_node(TOPO, n, reports, None)
    return fold_cluster(TOPO, nodes, version=3)


def test_unknown_travels_through_rank_and_node_reports() -> None:
    rep = replace(make_report(1, used=2), unknown=ENGINE)
    back = decode_rank_report(encode_rank_report(rep), TOPO, 0)
    assert back.unknown == ENGINE
    assert decode_rank_report(encode_rank_report(make_report(1)), TOPO, 0).unknown == frozenset()
    util = fold_node(TOPO, 0, {0: make_report(0), 1: rep}, None)
    node = decode_node_report(encode_node_report(util, 1, 1), TOPO).util
    assert node.ranks[1].unknown == ENGINE and node.ranks[0].unknown == frozenset()
    assert node.unknown == {"cached": (1,), "committed": (1,), "deltas": (1,)}


def test_a_report_naming_other_fields_is_refused() -> None:
    rep = replace(make_report(1), unknown=frozenset({"used"}))
    with pytest.raises(ReportError, match="bad_field"):
        decode_rank_report(encode_rank_report(rep), TOPO, 0)


def test_the_view_says_which_ranks_it_could_not_count() -> None:
    view = view_with_engines({1, 2})
    assert view.unknown == {"cached": (1, 2), "committed": (1, 2), "deltas": (1, 2)}
    d = view_to_dict(view)
    assert d["unknown"]["cached"] == [1, 2] and d["nodes"][0]["ranks"][1]["unknown"] == sorted(
        ENGINE
    )
    assert "unknown: cached (ranks [1, 2])" in render_table(view)
    assert view_with_engines(set()).unknown == {}


def scrape(view: ClusterView) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(lambda: view))
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_prometheus_leaves_out_a_nodes_series_it_could_not_count() -> None:
    m = scrape(view_with_engines({1}))
    cached = {k for k in m["kvfold_gpu_blocks"] if ("state", "cached") in k}
    assert cached == {(("node", "1"), ("state", "cached"), ("window", "full"))}  # node 0 out
    assert m["kvfold_unknown_ranks"][(("field", "cached"), ("node", "0"))] == 1
    assert m["kvfold_unknown_ranks"][(("field", "cached"), ("node", "1"))] == 0
    committed = {k[0] for k in m["kvfold_gpu_committed_blocks"]}
    assert committed == {("node", "1")}
    used = m["kvfold_gpu_blocks"][(("node", "0"), ("state", "used"), ("window", "full"))]
    assert used == 2 + 2  # used is published by both kinds of rank
    assert not any(("state", "cached") in k for k in m.get("kvfold_cluster_gpu_blocks", {}))


class _Views:
    def __init__(self, view: ClusterView) -> None:
        self.v = view

    def view(self) -> ClusterView:
        return self.v

    def wait_for_version(self, version: int, timeout_s: float = 0.0) -> ClusterView | None:
        return None


def test_admission_never_promises_room_it_cannot_see() -> None:
    ctl = AdmissionController(_Views(view_with_engines({0, 1, 2, 3})))  # type: ignore[arg-type]
    d = ctl.decide(AdmissionRequest("e1", prompt_tokens=8, max_new_tokens=4))
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "capacity_unknown")
    ctl = AdmissionController(_Views(view_with_engines({0, 1})))  # type: ignore[arg-type]
    for i in range(6):
        d = ctl.decide(AdmissionRequest(f"k{i}", prompt_tokens=8, max_new_tokens=4))
        assert d.outcome is Outcome.ADMIT and d.rank in (2, 3)
