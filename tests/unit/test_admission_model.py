"""Model-based: controllers admitting into real rank caches through stale views.

Random sequences of decisions, placements (delivered late, in each controller's
order), growth in random steps up to the declared length, releases, rank reports
taken at random moments and view refreshes, with prompts that share prefixes, on a
full-attention pool and a sliding window. The promises checked after every step:

- every rank's committed blocks recount exactly and never exceed its total;
- under GUARANTEED_NO_EVICT every placed request reaches its declared length;
- with one controller under GUARANTEED_NO_EVICT the rank never refuses a placement;
- under MAX_UTILIZATION a placed request always gets its first block of growth;
- with several controllers and a claim desk (kvfold.admission.claims), a request
  promised under a granted claim is never refused, however stale the others' views.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.admission import AdmissionController, AdmissionRequest, Decision, Outcome, Policy
from kvfold.admission.claims import Claim, ClaimDesk, ClaimNote
from kvfold.aggregator.fold import RankRecord, fold_cluster, fold_node
from kvfold.stats import RankReport
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from kvfold.worker import PagedKVCache
from kvfold.worker.tickets import TicketBook
from tests.unit.builders import make_cache

B = 4
WINDOWS = (None, 12)
TOPO = Topology(3, 2)  # two nodes, the second partial


@dataclass
class Placed:
    rank: int
    tokens: int
    end: int  # declared length
    first_block_end: int  # MAX_UTILIZATION: what growth is promised


class AdmissionModel(RuleBasedStateMachine):
    num_controllers = 1
    policy = Policy.GUARANTEED_NO_EVICT
    claims = False  # the controllers exchange with a claim desk

    def __init__(self) -> None:
        super().__init__()
        self.caches: dict[int, PagedKVCache] = {
            r: make_cache(num_blocks={None: 14, 12: 8}, windows=WINDOWS, tokens_per_block=B)
            for r in range(TOPO.world_size)
        }
        self.books = {r: TicketBook() for r in self.caches}
        self.reports: dict[int, RankReport] = {}
        self.silent: set[int] = set()  # ranks the views show stale until they report again
        self.version = 0
        self.view: ClusterView | None = None
        for r in self.caches:
            self._report(r)
        self.desk = ClaimDesk()
        self.ctls = [
            AdmissionController(
                self.current_view,
                policy=self.policy,
                refresh_interval_s=1e9,
                num_controllers=self.num_controllers,
                reservation_ttl_s=1e9,
                claim_source=self.exchange if self.claims else None,
            )
            for _ in range(self.num_controllers)
        ]
        for c in self.ctls:
            c.refresh(force=True)
        self.pending: list[deque[tuple[str, list[int], int, Decision]]] = [
            deque() for _ in self.ctls
        ]
        self.placed: dict[str, Placed] = {}
        self.next_id = 0
        self.admitted = 0
        self.claimed = 0  # placements under a granted claim

    def exchange(self, controller_id: str, note: ClaimNote) -> tuple[Claim, ...]:
        return self.desk.exchange(controller_id, note, 0.0)  # no controller lapses

    def current_view(self) -> ClusterView:
        assert self.view is not None
        return self.view

    def _report(self, r: int) -> None:
        cache = self.caches[r]
        stats = cache.stats()
        self.version += 1
        self.reports[r] = RankReport(
            rank=r,
            incarnation=1,
            seq=self.version,
            gpu=dict(stats.windows),
            deltas={},
            num_sequences_by_status=dict(stats.num_sequences_by_status),
            tickets=self.books[r].snapshot(),
            num_refused=cache.num_refused,
        )
        self.silent.discard(r)
        self._fold()

    def _fold(self) -> None:
        self.version += 1
        stale = SourceState.STALE
        nodes = {
            n: fold_node(
                TOPO,
                n,
                {
                    q: RankRecord(self.reports[q], stale if q in self.silent else None)
                    for q in TOPO.ranks_on(n)
                    if q in self.reports
                },
                None,
            )
            for n in range(TOPO.num_nodes)
        }
        self.view = fold_cluster(TOPO, nodes, version=self.version)

    # ------------------------------------------------------------------ rules

    @rule(
        c=st.integers(0, 3),
        prefix=st.integers(0, 2),
        prompt=st.integers(1, 24),
        max_new=st.integers(0, 24),
    )
    def decide(self, c: int, prefix: int, prompt: int, max_new: int) -> None:
        c %= len(self.ctls)
        self.next_id += 1
        rid = f"q{self.next_id}"
        # three families of prompts that share their first blocks
        tokens = [prefix * 1000 + i for i in range(min(prompt, 12))]
        tokens += [self.next_id * 100 + i for i in range(prompt - len(tokens))]
        policy = self.ctls[c].policy
        lease = policy.room().copy()  # what this controller may promise, per window and rank
        d = self.ctls[c].decide(AdmissionRequest(rid, prompt, max_new))
        if d.outcome is Outcome.ADMIT:
            self.pending[c].append((rid, tokens, max_new, d))
            self.admitted += 1
            # beyond its lease on every fresh rank (only where controllers share ranks)
            assert policy.index is not None
            need = np.array([d.blocks[w] for w in policy.index.windows])[:, None]
            within = bool(((lease >= need).all(0) & policy.index.fresh).any())
            beyond = "fits_claim" if self.claims else "fits_overflow"
            assert (d.reason == beyond) == (not within), (d, lease[:, d.rank])

    @rule(c=st.integers(0, 3))
    def deliver(self, c: int) -> None:
        c %= len(self.ctls)
        if not self.pending[c]:
            return
        rid, tokens, max_new, d = self.pending[c].popleft()
        assert d.rank is not None and d.policy is not None
        cache = self.caches[d.rank]
        ok = cache.add_sequence(rid, tokens, max_new_tokens=max_new, policy=d.policy)
        self.books[d.rank].take(d.ticket)
        if self.num_controllers == 1 and self.policy is Policy.GUARANTEED_NO_EVICT:
            assert ok, f"rank {d.rank} refused {rid}: one controller over-committed it"
        if d.reason == "fits_claim":
            self.claimed += 1
            assert ok, f"rank {d.rank} refused {rid}, promised under a granted claim"
        if ok:
            end = len(tokens) + max_new
            self.placed[rid] = Placed(d.rank, len(tokens), end, len(tokens) + min(max_new, B))
        else:
            self.ctls[c].release(rid)

    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 9))
    def grow(self, pick: int, n: int) -> None:
        if not self.placed:
            return
        rid = sorted(self.placed)[pick % len(self.placed)]
        p = self.placed[rid]
        n = min(n, p.end - p.tokens)
        if n == 0:
            return
        ok = self.caches[p.rank].append_tokens(rid, list(range(n)))
        promised = p.end if self.policy is Policy.GUARANTEED_NO_EVICT else p.first_block_end
        if p.tokens + n <= promised:
            assert ok, f"{rid} refused growth {p.tokens} -> {p.tokens + n} within {promised}"
        if ok:
            p.tokens += n

    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        if not self.placed:
            return
        rid = sorted(self.placed)[pick % len(self.placed)]
        self.caches[self.placed.pop(rid).rank].free_sequence(rid)

    @rule(r=st.integers(0, TOPO.world_size - 1))
    def report(self, r: int) -> None:
        self._report(r)

    @rule(r=st.integers(0, TOPO.world_size - 1))
    def go_stale(self, r: int) -> None:
        """The rank falls silent: views show it stale (never a candidate) until it reports."""
        self.silent.add(r)
        self._fold()

    @rule(c=st.integers(0, 3))
    def refresh(self, c: int) -> None:
        self.ctls[c % len(self.ctls)].refresh(force=True)

    @rule(first=st.integers(0, 3))
    def refresh_all(self, first: int) -> None:
        """Every controller refreshes, one after another (what moves a claim along)."""
        n = len(self.ctls)
        for i in range(n):
            self.ctls[(first + i) % n].refresh(force=True)

    @rule(r=st.integers(0, TOPO.world_size - 1))
    def report_and_refresh_all(self, r: int) -> None:
        self._report(r)
        for c in self.ctls:
            c.refresh(force=True)

    # ------------------------------------------------------------------ promises

    @invariant()
    def caches_recount_and_never_over_commit(self) -> None:
        for cache in self.caches.values():
            cache.check_integrity()  # committed recounts, used <= committed <= total

    @precondition(lambda self: self.claims)
    @invariant()
    def a_usable_grant_fits_beside_every_promise_still_on_its_way(self) -> None:
        """Whatever order the others' promises arrive in, what a grant lets its owner
        promise fits: the rank's room now less every promise not delivered yet."""
        for ctl in self.ctls:
            policy, idx = ctl.policy, ctl.policy.index
            assert policy.claims is not None and idx is not None
            whole = idx.room - policy.watermark_blocks
            granted = policy.claims.grant_room(idx.version, idx.windows, whole, policy.reserved)
            if granted is None:
                continue
            r, room = granted
            windows = self.caches[r].stats().windows
            for i, w in enumerate(idx.windows):
                on_way = sum(d.blocks[w] for q in self.pending for _, _, _, d in q if d.rank == r)
                free = windows[w].num_blocks_room - on_way
                assert room[i] <= free, (r, w, room[i], free)

    @precondition(lambda self: self.num_controllers == 1)
    @invariant()
    def one_controller_is_never_refused(self) -> None:
        if self.policy is Policy.GUARANTEED_NO_EVICT:
            assert all(c.num_refused == 0 for c in self.caches.values())


class OneControllerGuaranteed(AdmissionModel):
    pass


class OneControllerMaxUtilization(AdmissionModel):
    policy = Policy.MAX_UTILIZATION


class ThreeControllersGuaranteed(AdmissionModel):
    num_controllers = 3


class ThreeControllersWithClaims(AdmissionModel):
    num_controllers = 3
    claims = True


SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestOneControllerGuaranteed = OneControllerGuaranteed.TestCase
TestOneControllerGuaranteed.settings = settings(SETTINGS, max_examples=200)
TestOneControllerMaxUtilization = OneControllerMaxUtilization.TestCase
TestOneControllerMaxUtilization.settings = SETTINGS
TestThreeControllersGuaranteed = ThreeControllersGuaranteed.TestCase
TestThreeControllersGuaranteed.settings = SETTINGS
TestThreeControllersWithClaims = ThreeControllersWithClaims.TestCase
TestThreeControllersWithClaims.settings = settings(
    SETTINGS, max_examples=150, stateful_step_count=80
)
