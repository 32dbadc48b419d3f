"""Liveness and safety of several controllers through the running system, claims on and
off: controllers in processes of their own (start_controllers), ranks rebound to window
configurations whose pools are smaller than the controllers times a request, and the
aggregator's claim desk between them.

Each case is a seeded random sequence of decisions (a queued request decided again at
the scheduler's own pace, or given up), placements on the chosen rank (now, or later),
growth up to the declared length, releases and pauses; then the cluster goes idle and
requests of random sizes are decided again at random paces until admitted. What must
hold:

- liveness: on an idle cluster, a request that an empty rank's cache takes (the
  oracle: a PagedKVCache of the same configuration, here) is admitted; the stall this
  was written for queued every such request `awaiting_claim` forever;
- safety: a placement promised under a granted claim is never refused, nor one by a
  single controller; a placed request always grows to its declared length; every
  rank's cache keeps its own counts (check_integrity) and never commits past its total.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest

from kvfold.admission import AdmissionRequest, Decision, Outcome, Policy, new_controller_id
from kvfold.worker import KVCacheConfig, PagedKVCache
from kvfold.worker.windows import ceil_div
from tests.integration.conftest import running, wait_until
from tests.unit.builders import make_config

pytestmark = pytest.mark.integration

B = 4  # tokens per block
WORLD = 4
REPORT_S = 0.1
# a decision the scheduler makes again within the controllers' hold (1 s): its pace
RETRY_PACES_S = (0.02, 0.1, 0.3, 0.6)
IDLE_ADMIT_TIMEOUT_S = 30.0  # a stall is forever; a busy 2-core machine is slow, not stuck


def config(num_blocks: dict[int | None, int]) -> KVCacheConfig:
    windows = tuple(num_blocks)
    return make_config(
        num_blocks,
        windows=windows,
        tokens_per_block=B,
        num_layers=len(windows),
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        device="cpu",
    )


# (windows' pools, controllers, claims): the issue's pool first (window 8: 6 blocks, a
# lease of 1 among 4 controllers, where a request of 8 + 4 tokens needs 3)
CASES = [
    ({None: 24, 8: 6}, 4, True),
    ({None: 24, 8: 6}, 4, False),
    ({None: 24, 8: 6}, 1, True),
    ({None: 12}, 2, True),
    ({None: 16, 8: 4, 16: 6}, 3, True),
    ({None: 12}, 3, False),
]


@pytest.fixture(scope="module")
def kv():  # type: ignore[no-untyped-def]
    # launched with every window the cases use (the aggregator takes the windows it was
    # launched with); each case rebinds the ranks to its own pools, some windows left out
    first = config({None: 16, 8: 4, 16: 6})
    with running(2, 2, WORLD, cache=first, report_interval_s=REPORT_S) as (_, deployment):
        deployment.wait_until_fresh()
        yield deployment


def rebind(kv: Any, cfg: KVCacheConfig) -> None:
    """Every rank empty, with `cfg`'s pools, and a view that shows them all."""
    for r in range(WORLD):
        kv.rank(r).call("bind", cfg)
        kv.rank(r).report_now()
    want = {w: cfg.num_blocks_of(w) for w in cfg.windows}

    def shown() -> bool:
        view = kv.view()
        for r in range(WORLD):
            s = view.rank_summary(r)
            if s is None or s[0].state.value != "fresh":
                return False
            gpu = s[0].gpu
            if set(gpu) != set(want) or any(
                gpu[w].num_blocks_total != n or gpu[w].num_blocks_committed for w, n in want.items()
            ):
                return False
        return True

    wait_until(shown, timeout_s=30)


@dataclass
class Live:
    rank: int
    tokens: int
    end: int  # the declared length: how far it grows


class Scheduler:
    """A scheduler's loop over the controllers, with its queue of decided-again requests."""

    def __init__(self, kv: Any, ctls: list[Any], cfg: KVCacheConfig, seed: int) -> None:
        self.kv, self.ctls, self.cfg = kv, ctls, cfg
        self.rnd = random.Random(seed)
        self.queued: deque[tuple[int, AdmissionRequest]] = deque()
        self.pending: deque[tuple[AdmissionRequest, Decision]] = deque()
        self.live: dict[str, Live] = {}
        self.next_id = 0
        self.claimed = self.refused = self.placed = 0
        self.idle_waits_s: list[float] = []

    def request(self) -> AdmissionRequest:
        self.next_id += 1
        rid = f"c{self.next_id}-{self.rnd.getrandbits(24)}"
        return AdmissionRequest(rid, self.rnd.randint(1, 40), self.rnd.randint(0, 40))

    def decide(self, k: int, request: AdmissionRequest) -> Decision:
        import ray

        d: Decision = ray.get(self.ctls[k].decide.remote(request))
        if d.outcome is Outcome.ADMIT:
            self.pending.append((request, d))
        return d

    def tokens(self, request: AdmissionRequest) -> list[int]:
        family = hash(request.request_id) % 3  # prompts that share their first blocks
        head = [family * 10_000 + i for i in range(min(request.prompt_tokens, 12))]
        n = request.prompt_tokens - len(head)
        return head + [self.next_id * 1000 + i for i in range(n)]

    def deliver(self) -> str | None:
        if not self.pending:
            return None
        request, d = self.pending.popleft()
        assert d.rank is not None
        ok = self.kv.rank(d.rank).add_sequence(
            request.request_id,
            self.tokens(request),
            max_new_tokens=request.max_new_tokens,
            policy=d.policy,
            ticket=d.ticket,
        )
        if d.reason == "fits_claim":
            self.claimed += 1
            assert ok, f"rank {d.rank} refused {request.request_id}, promised under a claim"
        if len(self.ctls) == 1:
            assert ok, f"rank {d.rank} refused {request.request_id}: one controller over-committed"
        if not ok:
            self.refused += 1  # the overflow rule's collision, caught by the rank
            return None
        self.placed += 1
        end = request.prompt_tokens + request.max_new_tokens
        self.live[request.request_id] = Live(d.rank, request.prompt_tokens, end)
        return request.request_id

    def grow(self) -> None:
        if self.live:
            rid = self.rnd.choice(sorted(self.live))
            s = self.live[rid]
            n = min(self.rnd.randint(1, 12), s.end - s.tokens)
            if n > 0:
                assert self.kv.rank(s.rank).append_tokens(rid, list(range(n))), (rid, s)
                s.tokens += n

    def release(self) -> None:
        if self.live:
            rid = self.rnd.choice(sorted(self.live))
            self.kv.rank(self.live.pop(rid).rank).free_sequence(rid)

    def play(self, steps: int) -> None:
        """Mixed load: new requests, the queue decided again (or given up), placements,
        growth, releases and pauses, in a random order."""
        for _ in range(steps):
            op = self.rnd.random()
            if op < 0.3:
                k = self.rnd.randrange(len(self.ctls))
                r = self.request()
                if self.decide(k, r).outcome is Outcome.QUEUE:
                    self.queued.append((k, r))
            elif op < 0.45 and self.queued:
                k, r = self.queued.popleft()
                if self.rnd.random() < 0.8 and self.decide(k, r).outcome is Outcome.QUEUE:
                    self.queued.append((k, r))  # else: given up
            elif op < 0.6:
                self.deliver()
            elif op < 0.8:
                self.grow()
            elif op < 0.92:
                self.release()
            else:  # the scheduler looks away: the operation itself, not a wait
                time.sleep(self.rnd.choice(RETRY_PACES_S))

    def go_idle(self) -> None:
        """Every admitted request placed, grown to its declared length, and gone."""
        while self.pending:
            self.deliver()
        for rid in sorted(self.live):
            s = self.live.pop(rid)
            if s.end > s.tokens:
                assert self.kv.rank(s.rank).append_tokens(rid, list(range(s.end - s.tokens))), rid
            self.kv.rank(s.rank).free_sequence(rid)
        for r in range(WORLD):
            self.kv.rank(r).check_integrity()

    def admit_when_idle(self, request: AdmissionRequest) -> None:
        """Decide `request` again at a random pace (the scheduler's, the condition's poll)
        until it is admitted; place it."""
        k = self.rnd.randrange(len(self.ctls))
        pace = self.rnd.choice(RETRY_PACES_S)
        start = time.monotonic()

        def admitted() -> Decision | None:
            d = self.decide(k, request)
            assert d.outcome is not Outcome.REJECT, d
            return d if d.outcome is Outcome.ADMIT else None

        d = wait_until(admitted, timeout_s=IDLE_ADMIT_TIMEOUT_S, interval_s=pace)
        self.idle_waits_s.append(time.monotonic() - start)
        assert self.deliver() == request.request_id, f"an idle rank refused {request}: {d}"
        self.go_idle()

    def fits_an_empty_rank(self, request: AdmissionRequest) -> bool:
        oracle = PagedKVCache(self.cfg)
        tokens = list(range(request.prompt_tokens))
        return oracle.add_sequence("x", tokens, max_new_tokens=request.max_new_tokens)


@pytest.mark.parametrize(("num_blocks", "num_controllers", "claims"), CASES)
def test_an_idle_cluster_admits_what_fits_whatever_the_controllers_and_windows(
    kv: Any, num_blocks: dict[int | None, int], num_controllers: int, claims: bool
) -> None:
    import ray

    from kvfold.replay.scheduler_actor import start_controllers

    cfg = config(num_blocks)
    rebind(kv, cfg)
    ids = [new_controller_id(f"claims-{i}") for i in range(num_controllers)]
    ctls = start_controllers(
        kv.settings.namespace,
        num_controllers,
        Policy.GUARANTEED_NO_EVICT,
        controller_ids=ids,
        claims=claims,
    )
    seed = sum(num_blocks.values()) * 10 + num_controllers + 100 * claims
    run = Scheduler(kv, ctls, cfg, seed)
    try:
        run.go_idle()
        # the requests first: 8 prompt tokens and 4 new, on each controller
        for _ in range(num_controllers):
            run.admit_when_idle(AdmissionRequest(f"first{run.rnd.getrandbits(30)}", 8, 4))
        run.play(steps=60)
        run.go_idle()
        tried = 0
        while tried < 4:
            r = run.request()
            if run.fits_an_empty_rank(r):
                run.admit_when_idle(r)
                tried += 1
            else:  # never admitted, by any controller
                d = run.decide(run.rnd.randrange(num_controllers), r)
                assert (d.outcome, d.reason) == (Outcome.REJECT, "exceeds_rank_capacity"), d
        counts = ray.get([c.counts.remote() for c in ctls])
    finally:
        for c in ctls:
            ray.kill(c)
    reasons: dict[str, int] = {}
    for c in counts:
        for key, n in c["decisions"].items():
            reasons[key] = reasons.get(key, 0) + n
    lease = min(n // num_controllers for n in num_blocks.values())
    beyond_a_lease = ceil_div(8 + 4, B) > lease
    if num_controllers > 1 and beyond_a_lease:
        # the requests that need more than a lease went the way of the case
        assert reasons.get("admit:fits_claim" if claims else "admit:fits_overflow", 0) > 0, reasons
    if not claims or num_controllers == 1:
        assert "queue:awaiting_claim" not in reasons, reasons
    waits = sorted(run.idle_waits_s)
    print(
        f"\n{num_blocks} x{num_controllers} claims={claims}: idle admissions "
        f"{len(waits)}, wait median {statistics.median(waits):.3f} s, max {waits[-1]:.3f} s; "
        f"placed {run.placed}, under claims {run.claimed}, refused {run.refused}; {reasons}"
    )
