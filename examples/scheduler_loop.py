"""A scheduler over kvfold: decide each request, place it on the rank the decision names
with its declared growth, decode it token by token, release it. Prints every decision.

    python examples/scheduler_loop.py                       # an embedded 2-node cluster
    python examples/scheduler_loop.py --address HOST:PORT --namespace NS   # kvfold up there

The rules a real scheduler needs are all here: pass `max_new_tokens`, the decision's
`policy` and `ticket` to the rank; a placement the rank refuses goes back to the head
of the queue (`release` first); a rank that fails hands its requests back to be
decided again (counted `restarted`), and one that can no longer fit anywhere after
that is `failed`.
"""

from __future__ import annotations

import argparse
import random

from kvfold.ray_env import apply_local_defaults

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--address", default=None, help="a Ray cluster running kvfold (`kvfold up`)")
p.add_argument("--namespace", default="kvfold-example")
p.add_argument("--requests", type=int, default=24)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
apply_local_defaults(args.address)  # before Ray is imported (docs/security.md)

from kvfold.admission import (  # noqa: E402  (after the Ray settings)
    AdmissionController,
    AdmissionRequest,
    FifoAdmissionQueue,
    Outcome,
)
from kvfold.cluster import KVFold, launch, start_local_cluster  # noqa: E402
from kvfold.errors import RankUnavailable  # noqa: E402
from kvfold.worker import KVCacheConfig  # noqa: E402
from kvfold.worker.hashing import block_keys  # noqa: E402

cluster = None
if args.address is None:
    cluster = start_local_cluster(2, 2, namespace=args.namespace)
    kv = launch(3, 2, cache=KVCacheConfig(tokens_per_block=16, num_blocks=96, device="auto"),
                namespace=args.namespace)  # fmt: skip
else:
    from kvfold.aggregator.client import connect

    connect(args.address, args.namespace)
    kv = KVFold.attach(args.namespace)
kv.wait_until_fresh()

# Requests: a shared 256-token system prompt on most of them, then their own part.
rng = random.Random(args.seed)
system = list(range(1, 257))
prompts, wanted = {}, {}
for i in range(args.requests):
    own = [rng.randrange(1000, 30000) for _ in range(rng.randrange(20, 400))]
    prompts[f"req-{i}"] = (system if rng.random() < 0.8 else []) + own
    wanted[f"req-{i}"] = rng.randrange(8, 64)  # max_new_tokens


def to_request(rid: str) -> AdmissionRequest:
    keys = tuple(block_keys(prompts[rid], 16))  # lets the router find cached prefixes
    return AdmissionRequest(rid, len(prompts[rid]), wanted[rid], keys)


controller = AdmissionController(kv.client, watermark_blocks=4)  # routes by the block index
queue: FifoAdmissionQueue[str] = FifoAdmissionQueue(to_request)
for rid in prompts:
    queue.push(rid)
running: dict[str, tuple[int, int]] = {}  # request -> (rank, tokens still to generate)
ever_ran: set[str] = set()
done = restarted = failed = refused = 0


def lose_rank(rank: int, why: str) -> None:
    """A rank failed: every request on it lost its KV; decide each again, first."""
    global restarted
    lost = [rid for rid, (r, _) in running.items() if r == rank]
    for rid in lost:
        del running[rid]
        controller.release(rid)
    queue.push_front(lost)
    restarted += len(lost)
    print(f"  rank {rank} failed ({why}): {len(lost)} requests decided again")


step = 0
while queue or running:
    step += 1
    controller.refresh(force=True)  # the newest view, and the block index with it
    for rid, d in queue.pump(controller.decide):
        if d.outcome is Outcome.QUEUE:
            print(f"step {step:3}  {rid:7} QUEUE   {d.reason}")
            continue
        if d.outcome is Outcome.REJECT:  # it can never fit (or no longer, after a fault)
            failed += rid in ever_ran
            print(f"step {step:3}  {rid:7} REJECT  {d.reason}")
            continue
        print(f"step {step:3}  {rid:7} ADMIT   rank {d.rank} ({d.reason}, "
              f"{d.prefix_blocks} blocks cached, {d.blocks} promised)")  # fmt: skip
        assert d.rank is not None
        try:
            placed = kv.rank(d.rank).add_sequence(
                rid, prompts[rid], max_new_tokens=wanted[rid], policy=d.policy, ticket=d.ticket
            )
        except RankUnavailable as e:
            controller.release(rid)
            queue.push_front([rid])
            lose_rank(d.rank, str(e))
            continue
        if not placed:  # another scheduler took the room first: try again, first in line
            refused += 1
            controller.release(rid)
            queue.push_front([rid])
            continue
        running[rid] = (d.rank, wanted[rid])
        ever_ran.add(rid)
    for rid, (rank, left) in list(running.items()):  # one decode step for each
        try:
            if left > 1:
                assert kv.rank(rank).append_tokens(rid, [7]), "growth within the promise"
                running[rid] = (rank, left - 1)
            else:
                kv.rank(rank).free_sequence(rid, report=True)
                del running[rid]
                done += 1
        except RankUnavailable as e:
            lose_rank(rank, str(e))
    if step > 50 * args.requests:
        raise SystemExit("no progress: is kvfold reporting?")

print(f"completed {done} of {args.requests} in {step} steps; refused by a rank {refused}, "
      f"restarted {restarted}, failed {failed}")  # fmt: skip
print("decisions:", dict(sorted((f"{o}:{r}", n) for (o, r), n in controller.decisions.items())))
if cluster is not None:  # ours: stop it; a kvfold we attached to stays up
    kv.shutdown()
    cluster.shutdown()
raise SystemExit(0 if done + failed == args.requests else 1)
