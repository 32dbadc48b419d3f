"""Model-based: controllers admitting into real rank caches through stale views.

Random sequences of decisions, placements (delivered late, in each controller's
order), growth in random steps up to the declared length, releases, rank reports
taken at random moments, view refreshes and time passing, with prompts that share
prefixes, on window configurations drawn per run (full attention alone, one or two
sliding windows; pools as small as one request, smaller than the controllers times a
request). 1 to 4 controllers, with the claim desk and without. The promises checked
after every step:

- every rank's committed blocks recount exactly and never exceed its total;
- under GUARANTEED_NO_EVICT every placed request reaches its declared length;
- with one controller under GUARANTEED_NO_EVICT the rank never refuses a placement;
- under MAX_UTILIZATION a placed request always gets its first block of growth;
- with several controllers and a claim desk (kvfold.admission.claims), a request
  promised under a granted claim is never refused, however stale the others' views;
- liveness, whatever came before: once the cluster is idle, a request that an empty
  rank's cache takes (the oracle) is admitted within the rounds of refreshes a claim
  needs, plus a hold for the claims others asked for and then stopped wanting; one
  an empty rank cannot take is rejected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfold.admission import AdmissionController, AdmissionRequest, Decision, Outcome, Policy
from kvfold.admission.claims import Claim, ClaimDesk, ClaimNote
from kvfold.aggregator.fold import RankRecord, fold_cluster, fold_node
from kvfold.stats import RankReport
from kvfold.tickets import TicketBook
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_cache

B = 4
TOPO = Topology(3, 2)  # two nodes, the second partial
# (windows, blocks per window): what every rank's cache holds, drawn once per run
CONFIGS: tuple[tuple[tuple[int | None, ...], dict[int | None, int]], ...] = (
    ((None,), {None: 14}),
    ((None,), {None: 7}),  # a request may take the whole pool
    ((None, 12), {None: 14, 12: 8}),
    ((None, 8), {None: 24, 8: 6}),  # the window's pool is smaller than 4 leases of a request
    ((None, 8), {None: 10, 8: 3}),  # one request's window peak fills it
    ((None, 8, 16), {None: 16, 8: 4, 16: 6}),
)
INTERVAL_S = 0.1  # each controller's refresh interval, on the model's clock
HOLD_S = 1.0  # its view_timeout_s: the hold after which a claim nobody wants ends
# an idle cluster's request: a claim's ask, freeze, ack, grant and use take 4 rounds; a
# claim another controller asked for and stopped wanting ends a hold (and a round) later;
# a scheduler deciding every k rounds adds up to k before its ask and k after the grant
LIVENESS_ROUNDS = round(HOLD_S / INTERVAL_S) + 8


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
        self.now = 0.0  # the controllers' and the desk's clock

    @initialize(config=st.sampled_from(CONFIGS))
    def start(self, config: tuple[tuple[int | None, ...], dict[int | None, int]]) -> None:
        self.windows, self.num_blocks = config
        self.caches: dict[int, PagedKVCache] = {r: self._empty() for r in range(TOPO.world_size)}
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
                refresh_interval_s=INTERVAL_S,  # a decision refreshes once the clock moved
                view_timeout_s=HOLD_S,
                clock=lambda: self.now,
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

    def _empty(self) -> PagedKVCache:
        return make_cache(
            num_blocks=self.num_blocks,
            windows=self.windows,
            tokens_per_block=B,
            num_layers=len(self.windows),
        )

    def exchange(self, controller_id: str, note: ClaimNote) -> tuple[Claim, ...]:
        return self.desk.exchange(controller_id, note, self.now)

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
        self.ctls[c].refresh()  # in line, when due: the lease read next is the one it decides on
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
            if not self.grown_past_promise(d.rank):
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

    @rule(dt=st.sampled_from([0.01, INTERVAL_S, 0.5, HOLD_S + 0.2]), first=st.integers(0, 3))
    def time_passes(self, dt: float, first: int) -> None:
        """Nobody decides for a while, and every controller refreshes (as its thread
        does): grants wait, claims nobody wants end. (A controller silent past its hold
        is forgotten by the desk, and what it promised before and delivers later is in
        no ack: docs/admission.md, "Claims", says what catches that; not modelled.)"""
        self.now += dt
        self.refresh_all(first)

    @rule(
        c=st.integers(0, 3),
        prompt=st.integers(1, 24),
        max_new=st.integers(0, 24),
        every=st.integers(1, round(HOLD_S / INTERVAL_S) - 1),
    )
    def idle_then_admit(self, c: int, prompt: int, max_new: int, every: int) -> None:
        """Liveness: everything placed runs out and leaves, and a scheduler decides one
        request again every `every` refresh intervals (at its own pace, within a hold)
        until it is admitted; the controllers refresh at every interval."""
        for k in range(len(self.ctls)):
            while self.pending[k]:
                self.deliver(k)
        for rid in sorted(self.placed):
            self.caches[self.placed.pop(rid).rank].free_sequence(rid)
        for r in self.caches:
            self._report(r)
        ctl = self.ctls[c % len(self.ctls)]
        self.next_id += 1
        rid = f"idle{self.next_id}"
        request = AdmissionRequest(rid, prompt, max_new)
        oracle = self._empty()  # whether an empty rank takes it to its full length
        fits = oracle.add_sequence("x", list(range(prompt)), max_new_tokens=max_new)
        rounds = LIVENESS_ROUNDS + 2 * every
        for i in range(rounds):
            self.now += INTERVAL_S
            self.refresh_all(i)
            if i % every:
                continue
            d = ctl.decide(request)
            if not fits:
                assert (d.outcome, d.reason) == (Outcome.REJECT, "exceeds_rank_capacity"), d
                return
            assert d.outcome is not Outcome.REJECT, d
            if d.outcome is Outcome.ADMIT:
                tokens = [10**6 + self.next_id * 100 + j for j in range(prompt)]
                self.pending[c % len(self.ctls)].append((rid, tokens, max_new, d))
                self.admitted += 1
                self.deliver(c % len(self.ctls))
                assert rid in self.placed, f"an idle rank refused {rid}: {d}"
                return
        raise AssertionError(
            f"{rid} ({prompt}+{max_new} tokens) fits an empty rank of {self.num_blocks} "
            f"but was not admitted within {rounds} refresh intervals on an idle cluster, "
            f"decided every {every}: last {d}, board {self.desk.board()}"
        )

    # ------------------------------------------------------------------ promises

    @invariant()
    def caches_recount_and_never_over_commit(self) -> None:
        for cache in self.caches.values():
            cache.check_integrity()  # committed recounts, used <= committed <= total

    def grown_past_promise(self, r: int) -> bool:
        """Under MAX_UTILIZATION a running request on rank `r` has grown past what was
        promised it (its prompt and one block), into room no view knew of: a claim's room
        holds against every promise, not against that growth, and the rank's own check
        refuses what no longer fits (MAX_UTILIZATION's meaning: over-commit, the rank
        arbitrates)."""
        return self.policy is Policy.MAX_UTILIZATION and any(
            p.rank == r and p.tokens > p.first_block_end for p in self.placed.values()
        )

    @precondition(lambda self: self.claims)
    @invariant()
    def a_usable_grant_fits_beside_every_promise_still_on_its_way(self) -> None:
        """Whatever order the others' promises arrive in, what a grant lets its owner
        promise fits: the rank's room now less every promise not delivered yet. (A
        controller whose next decision refreshes first decides on no grant it holds
        now: the desk may have ended it, the owner having fallen silent past its hold.)"""
        for ctl in self.ctls:
            if ctl.refresh_due:
                continue
            policy, idx = ctl.policy, ctl.policy.index
            assert policy.claims is not None and idx is not None
            whole = idx.room - policy.watermark_blocks
            granted = policy.claims.grant_room(idx.version, idx.windows, whole, policy.reserved)
            if granted is None:
                continue
            r, room = granted
            if self.grown_past_promise(r):
                continue
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


class TwoControllersWithClaims(AdmissionModel):
    num_controllers = 2
    claims = True


class ThreeControllersWithClaims(AdmissionModel):
    num_controllers = 3
    claims = True


class FourControllersWithClaims(AdmissionModel):
    num_controllers = 4
    claims = True


class ThreeControllersGuaranteed(AdmissionModel):  # the overflow rule, without claims
    num_controllers = 3


class FourControllersMaxUtilization(AdmissionModel):
    num_controllers = 4
    policy = Policy.MAX_UTILIZATION
    claims = True


SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestOneControllerGuaranteed = OneControllerGuaranteed.TestCase
TestOneControllerGuaranteed.settings = settings(SETTINGS, max_examples=120)
TestOneControllerMaxUtilization = OneControllerMaxUtilization.TestCase
TestOneControllerMaxUtilization.settings = SETTINGS
TestTwoControllersWithClaims = TwoControllersWithClaims.TestCase
TestTwoControllersWithClaims.settings = SETTINGS
TestThreeControllersWithClaims = ThreeControllersWithClaims.TestCase
CLAIMS_SETTINGS = settings(SETTINGS, max_examples=100, stateful_step_count=80)
TestThreeControllersWithClaims.settings = CLAIMS_SETTINGS
TestFourControllersWithClaims = FourControllersWithClaims.TestCase
TestFourControllersWithClaims.settings = CLAIMS_SETTINGS
TestThreeControllersGuaranteed = ThreeControllersGuaranteed.TestCase
TestThreeControllersGuaranteed.settings = SETTINGS
TestFourControllersMaxUtilization = FourControllersMaxUtilization.TestCase
TestFourControllersMaxUtilization.settings = SETTINGS
