"""A driver on one host of tests/hosts: a scheduler loop over kvfold, recording what it saw,
one JSON line at a time. The first maps kvfold's nodes to their hosts' addresses:
{"hosts": {node: ip}}. Then, from two threads:
- every 50 ms, the view: {"kind": "view", "t", "version", "nodes": {node: state},
  "fresh_ranks", "counters", "gpu_total", "gpu_by_rank"};
- every step of the scheduler loop: {"kind": "step", "t", "nodes", "fresh_ranks" (of the
  view its decision is held against), "decision": {"id", "outcome", "rank", "reason",
  "placed"?}, "ended": [[id, "completed" | "failed: <error naming its rank>"]]}. It decides
  one request (kvfold.admission), places an admitted one on its rank (a rank call gives up
  after --call-timeout-s) and frees it a few steps later.
Runs until stopped (SIGTERM).

    python tests/hosts/watch_loop.py --address HEAD:PORT --namespace NS
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from kvfold.ray_env import apply_local_defaults

p = argparse.ArgumentParser()
p.add_argument("--address", required=True)
p.add_argument("--namespace", required=True)
p.add_argument("--hold-steps", type=int, default=5, help="steps a placed request stays")
p.add_argument("--call-timeout-s", type=float, default=2.0, help="a rank call's limit")
args = p.parse_args()
apply_local_defaults(args.address)  # before Ray is imported

import ray  # noqa: E402

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome  # noqa: E402
from kvfold.aggregator.client import connect  # noqa: E402
from kvfold.cluster import KVFold  # noqa: E402
from kvfold.display import view_to_dict  # noqa: E402
from kvfold.errors import KVFoldError  # noqa: E402

connect(args.address, args.namespace)
kv = KVFold.attach(args.namespace)
for r in range(kv.topology.world_size):  # a rank on a cut host answers nothing: give up soon
    kv.rank(r).timeout_s = args.call_timeout_s
by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
out_lock = threading.Lock()


def say(line: dict[str, Any]) -> None:
    with out_lock:
        print(json.dumps(line), flush=True)


say({"hosts": {i: by_id.get(nid) for i, nid in enumerate(kv.ray_node_ids)}})


def view_line(view: Any) -> dict[str, Any]:
    fresh = set(view.fresh_ranks)  # a fresh rank on a stale node is not: its node speaks for it
    return {
        "version": view.version,
        "nodes": {n.node: n.state.value for n in view.nodes},
        "fresh_ranks": sorted(view.fresh_ranks),
        "counters": view_to_dict(view)["totals"]["counters"],
        "gpu_total": view.gpu_total.num_blocks_total,
        "gpu_by_rank": {r.rank: r.gpu[None].num_blocks_total for n in view.nodes
                        for r in n.ranks if r.rank in fresh and None in r.gpu},
    }  # fmt: skip


def watch_views() -> None:
    """The view every 50 ms, whatever the scheduler is waiting on."""
    while True:
        t = time.time()
        try:
            say({"kind": "view", "t": t, **view_line(kv.view())})
        except KVFoldError as e:  # the aggregator itself out of reach: say so, go on
            say({"kind": "view", "t": t, "error": str(e)})
        time.sleep(0.05)


threading.Thread(target=watch_views, daemon=True).start()
controller = AdmissionController(kv.client)
placed: dict[str, tuple[int, int]] = {}  # request -> (rank, the step it ends)
step = 0
while True:
    step += 1
    line: dict[str, Any] = {"kind": "step", "t": time.time()}
    try:
        view = kv.view()  # what the decision below is held against
        controller.refresh(force=True)
        line["fresh_ranks"] = sorted(view.fresh_ranks)
        line["nodes"] = {n.node: n.state.value for n in view.nodes}
        rid = f"w{step}"
        d = controller.decide(AdmissionRequest(rid, prompt_tokens=32, max_new_tokens=8))
        decision = {"id": rid, "outcome": d.outcome.value, "rank": d.rank, "reason": d.reason}
        line["decision"] = decision
        if d.outcome is Outcome.ADMIT and d.rank is not None:
            try:
                if kv.rank(d.rank).add_sequence(rid, list(range(1, 33)), max_new_tokens=8,
                                                policy=d.policy, ticket=d.ticket):  # fmt: skip
                    placed[rid] = (d.rank, step + args.hold_steps)
                else:
                    controller.release(rid)
                    decision["placed"] = "refused_by_rank"
            except KVFoldError as e:
                controller.release(rid)
                decision["placed"] = f"failed: {e}"
    except KVFoldError as e:
        line["error"] = str(e)
    ended = []
    for rid, (rank, until) in list(placed.items()):
        if step < until:
            continue
        try:
            kv.rank(rank).free_sequence(rid, report=True)
            ended.append([rid, "completed"])
        except KVFoldError as e:
            ended.append([rid, f"failed: {e}"])
        controller.release(rid)
        del placed[rid]
    line["ended"] = ended
    say(line)
    time.sleep(0.05)
