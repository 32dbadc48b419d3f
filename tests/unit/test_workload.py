"""The engine model, trace loaders, generated workload and recorder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.stats import SequenceStatus
from kvfold.topology import Topology
from kvfold.worker.commitments import Policy
from kvfold.worker.engine import EngineRequest
from kvfold.worker.hashing import block_keys
from kvfold.workload.engine import SimEngine
from kvfold.workload.recorder import ReplayRecorder, sample_view
from kvfold.workload.requests import shared_prefix_workload
from kvfold.workload.traces import hash_id_tokens, load_azure, load_mooncake, load_trace
from tests.traces import AZURE_CODE, MOONCAKE
from tests.unit.builders import make_cache, make_report


def test_engine_prefills_decodes_and_frees() -> None:
    cache = make_cache(num_blocks=8)
    eng = SimEngine(cache)
    r = eng.step([EngineRequest("a", list(range(6)), max_new_tokens=3)])
    assert r.admitted == ("a",) and cache.status_of("a") is SequenceStatus.IN_PREFILL
    r = eng.step()  # prefill produces token 1 of 3
    assert cache.status_of("a") is SequenceStatus.PREFILLED
    r = eng.step(decode_tokens=1)
    assert cache.status_of("a") is SequenceStatus.IN_DECODE and cache.num_tokens("a") == 7
    r = eng.step(decode_tokens=5)  # only 1 left
    assert r.finished == ("a",) and not cache.has_sequence("a")
    cache.check_integrity()


def test_engine_refuses_what_does_not_fit_and_holds_what_cannot_grow() -> None:
    cache = make_cache(num_blocks=3)
    eng = SimEngine(cache)
    maxu = Policy.MAX_UTILIZATION
    r = eng.step(
        [
            EngineRequest("a", list(range(8)), 10, policy=maxu),  # commits 8 + 4 tokens: 3
            EngineRequest("b", list(range(50, 58)), 5, policy=maxu),  # 3 more: over-commit
        ]
    )
    assert r.admitted == ("a",) and r.refused == ("b",)
    assert cache.num_refused == 1
    eng.step()
    r = eng.step(decode_tokens=4)  # 8 -> 12 tokens: within what was promised
    assert r.decoded_tokens == 4 and not r.on_hold
    eng.drain()
    assert cache.stats().total.num_blocks_used == 0


def test_engine_preempts_when_nothing_can_move_and_recomputes_later() -> None:
    cache = make_cache(num_blocks=5)
    eng = SimEngine(cache)
    maxu = Policy.MAX_UTILIZATION
    a = EngineRequest("a", list(range(8)), 6, policy=maxu)  # 8 + 4 tokens: commits 3 blocks
    b = EngineRequest("b", list(range(100, 103)), 9, policy=maxu)  # 3 + 4 tokens: 2 blocks
    assert eng.step([a, b]).admitted == ("a", "b")
    eng.step()  # both prefilled
    r = eng.step(decode_tokens=8)  # a needs a 4th block, b a 3rd: 6 > 5 committed
    assert r.on_hold == ("a", "b") and r.preempted == ("b",)
    assert cache.status_of("b") is SequenceStatus.QUEUEING
    assert cache.stats().windows[None].num_blocks_committed == 3  # b's blocks are back
    done: list[str] = []
    for _ in range(10):
        r = eng.step(decode_tokens=8)
        assert not r.preempted or r.preempted == ("b",)
        done += [str(s) for s in r.finished]
        cache.check_integrity()
    assert done == ["a", "b"]  # a ran on; b was recomputed once a finished, then finished
    assert cache.num_refused == 0  # the engine's own retries of b are not refused placements
    assert cache.stats().total.num_blocks_used == 0


def test_shared_prefix_workload_is_deterministic_and_shares() -> None:
    a = shared_prefix_workload(50, 10.0, seed=3)
    b = shared_prefix_workload(50, 10.0, seed=3)
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    groups = [r for r in a if r.prefix_group == 0]
    assert len(groups) >= 2
    k0, k1 = block_keys(groups[0].prompt, 16), block_keys(groups[1].prompt, 16)
    assert k0[:16] == k1[:16]  # at least 256 shared tokens


def test_mooncake_prefix_sharing_is_exact_at_any_block_size() -> None:
    reqs = load_mooncake(MOONCAKE, limit=200)
    assert reqs[0].prompt_tokens == 40160 and reqs[0].arrival_s == 0.0
    assert np.array_equal(reqs[0].prompt[:512], hash_id_tokens(0))
    for tpb in (16, 64, 512):
        ka, kb = block_keys(reqs[0].prompt, tpb), block_keys(reqs[1].prompt, tpb)
        assert ka[0] != kb[0]  # different first hash ids share nothing


def test_azure_loader() -> None:
    reqs = load_azure(AZURE_CODE, limit=3)
    assert [(r.prompt_tokens, r.max_new_tokens) for r in reqs] == [(4808, 10), (3180, 8), (110, 27)]
    assert reqs[1].arrival_s == pytest.approx(0.052)


def test_bad_traces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="needs 2 hash_ids"):
        load_trace(bad)
    with pytest.raises(ValueError, match=r"\.jsonl"):
        load_trace(bad.with_suffix(".txt").resolve().parent)


def test_recorder_writes_csv_and_png(tmp_path: Path) -> None:
    topo = Topology(4, 2)
    rec = ReplayRecorder(num_requests=3, admitted=3, completed=3)
    for i in range(3):
        views = {}
        for n in range(2):
            reports = {r: make_report(r, used=i + r) for r in topo.ranks_on(n)}
            views[n] = fold_node(topo, n, reports, None)
        rec.samples.append(sample_view(fold_cluster(topo, views, version=i), i, 10.0 * i, 0, 1))
    rec.finish(fold_cluster(topo, views, version=9), 3.0)
    rec.write_csv(tmp_path / "s.csv")
    rec.write_png(tmp_path / "s.png")
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert len(lines) == 1 + 3 * 2  # header + 3 samples x 2 nodes
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "over-commits 0" in rec.format_summary()


def test_an_unsampled_stretch_is_a_gap_not_a_line(tmp_path: Path) -> None:
    """Samples due every 1 trace s; the driver sampled at 0, 1, 2, then not until 10:
    one gap, drawn as a break (a None row), counted in the summary with the overruns."""
    topo = Topology(2, 2)
    view = fold_cluster(topo, {0: fold_node(topo, 0, {0: make_report(0, used=3)}, None)})
    rec = ReplayRecorder(num_requests=1, sample_every_s=1.0, step_interval_s=0.05)
    for t in (0.0, 1.0, 2.0, 10.0, 11.0):
        rec.samples.append(sample_view(view, t / 20, t, 0, 0))
    rec.step_wall_s = [0.04, 0.05, 0.4, 0.04]  # one step took 8x its budget
    rec.finish(view, 1.0)
    assert rec.gaps() == [(2.0, 10.0)]
    t, rows = rec.plot_rows()
    assert [r.trace_s if r else None for r in rows] == [0.0, 1.0, 2.0, None, 10.0, 11.0]
    assert len(t) == len(rows)
    s = rec.summary()
    assert (s["driver_overruns"], s["driver_step_max_s"], s["picture_gaps"]) == (1, 0.4, 1)
    assert s["picture_gap_max_trace_s"] == 8.0
    assert "overran its step 1 times, longest 0.40 s; 1 gaps" in rec.format_summary()
    rec.write_png(tmp_path / "gap.png")
