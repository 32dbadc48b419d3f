"""precise_prefix's choice, decision after decision, against an independent recount.

A Hypothesis state machine drives one AdmissionPolicy routing by precise_prefix over
12 ranks on two nodes (the last one partial): ranks' GPUs and nodes' host tiers store
and drop keys of two prompts that share their first blocks, views move the ranks'
committed blocks, requests are decided and released, time passes the sent prompts'
TTL. Each decision must be the one a plain recount gives: per rank, the prompt's run
walked one key at a time (test_block_match's oracle), raised where this controller
sent the prompt's first block lately (the newest sending of a key, while it is neither
expired nor released), scored by the cost in kvfold.admission.routing's docstring;
the lowest cost among the ranks with room, ties to the most room, then the lower rank.
Costs within a billionth of the lowest are ties (the default onboard cost, 0.06, is not
exact in binary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvfold.admission import AdmissionPolicy, AdmissionRequest, Outcome, Router, blocks_needed
from kvfold.admission.routing import RoutingWeights
from kvfold.blockindex.feed import Replica
from kvfold.kvevents.events import HOST, RANK
from kvfold.stats import Window
from kvfold.topology import Topology
from kvfold.worker.commitments import Policy
from tests.unit.test_admission import make_view
from tests.unit.test_block_match import GPN, KEYS, B, oracle

WORLD = 12  # 8 ranks on node 0, 4 on node 1
TOTAL = 40  # blocks per rank
TTL_S = 2.0
SHARED = 3  # the two prompts' common first blocks
PROMPTS = (KEYS[:10], KEYS[:SHARED] + [bytes([100 + i]) * 8 for i in range(7)])
ALL_KEYS = sorted({k for p in PROMPTS for k in p})
# exact in binary, and the default (0.06 is not: near-ties within a billionth are ties)
WEIGHTS = ((4.0, 0.25), (1.0, 0.5), (2.0, 0.0), (3.0, 1.0), (4.0, 0.06))


@dataclass
class Sending:
    rank: int
    keys: list[bytes]
    at_s: float
    released: bool = False


@dataclass
class Placed:
    rank: int
    blocks: int  # promised in the one window the views have
    sending: Sending | None = field(default=None)


class PreciseRouting(RuleBasedStateMachine):
    windows: ClassVar[dict[int, Window]] = {0: None}

    @initialize(weights=st.sampled_from(WEIGHTS))
    def setup(self, weights: tuple[float, float]) -> None:
        self.weights = RoutingWeights(weights[0], weights[1], sent_ttl_s=TTL_S)
        self.policy = AdmissionPolicy(
            router=Router.PRECISE_PREFIX, weights=self.weights, reservation_ttl_s=1e9
        )
        self.topo = Topology(WORLD, GPN)
        self.committed = dict.fromkeys(range(WORLD), 0)
        self.version = 1
        self.now_s = 0.0
        self.policy.load_view(make_view(self.topo, total=TOTAL), self.now_s)
        self.replica = Replica([r // GPN for r in range(WORLD)])
        self.replica.index.windows.update(self.windows)
        self.replica.index.block_size = B
        self.policy.blocks = self.replica
        self.gpu: dict[tuple[int, int], set[bytes]] = {}
        self.host: dict[tuple[int, int], set[bytes]] = {}
        self.sendings: list[Sending] = []  # oldest first
        self.placed: dict[str, Placed] = {}
        self.n = 0

    # ------------------------------------------------------------------ holdings

    @rule(
        rank=st.integers(0, WORLD - 1),
        g=st.integers(0, 1),
        keys=st.sets(st.sampled_from(ALL_KEYS), min_size=1),
        drop=st.booleans(),
    )
    def gpu_changes(self, rank: int, g: int, keys: set[bytes], drop: bool) -> None:
        self._change(self.gpu, (RANK, rank), rank, g % len(self.windows), keys, drop)

    @rule(node=st.integers(0, 1), keys=st.sets(st.sampled_from(ALL_KEYS)), drop=st.booleans())
    def host_changes(self, node: int, keys: set[bytes], drop: bool) -> None:
        for g in self.windows:
            self._change(self.host, (HOST, node), node, g, keys, drop)

    def _change(
        self,
        model: dict[tuple[int, int], set[bytes]],
        source: tuple[str, int],
        i: int,
        g: int,
        keys: set[bytes],
        drop: bool,
    ) -> None:
        """`source` (rank or node i) stores or drops `keys` in group g: the index and
        the model alike."""
        held = model.setdefault((i, g), set())
        if drop:
            self.replica.index.remove(source, g, sorted(keys & held))
            held -= keys
        else:
            self.replica.index.store(source, g, sorted(keys - held))
            held |= keys

    # ------------------------------------------------------------------ views, time

    @rule(rank=st.integers(0, WORLD - 1), committed=st.integers(0, TOTAL))
    def a_view_moves_a_rank(self, rank: int, committed: int) -> None:
        self.committed[rank] = committed
        self.version += 1
        view = make_view(self.topo, used=self.committed, total=TOTAL, version=self.version)
        self.policy.load_view(view, self.now_s)

    @rule(dt=st.sampled_from([0.1, 0.7, 1.5, 2.5]))
    def time_passes(self, dt: float) -> None:
        self.now_s += dt

    # ------------------------------------------------------------------ requests

    @rule(
        which=st.integers(0, 1),
        n=st.integers(1, 10),
        extra=st.integers(0, B - 1),
        max_new=st.integers(1, 3 * B),
    )
    def decide(self, which: int, n: int, extra: int, max_new: int) -> None:
        keys = PROMPTS[which][:n]
        P = n * B + extra
        self.n += 1
        rid = f"r{self.n}"
        need = blocks_needed(P, max_new, (None,), B, Policy.GUARANTEED_NO_EVICT)[None]
        want = self._expected(keys, P, need)
        d = self.policy.decide(AdmissionRequest(rid, P, max_new, tuple(keys)), self.now_s)
        if want is None:
            assert d.outcome is Outcome.QUEUE, d
            return
        rank, prefix = want
        assert (d.outcome, d.rank, d.prefix_blocks) == (Outcome.ADMIT, rank, prefix), (d, want)
        sending = Sending(rank, keys, self.now_s)
        self.sendings.append(sending)
        self.placed[rid] = Placed(rank, need, sending)

    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        if not self.placed:
            return
        rid = sorted(self.placed)[pick % len(self.placed)]
        placed = self.placed.pop(rid)
        assert self.policy.release(rid)
        if placed.sending is not None:
            placed.sending.released = True

    @invariant()
    def promises_are_what_was_placed(self) -> None:
        if not hasattr(self, "policy"):
            return
        for r in range(WORLD):
            want = sum(p.blocks for p in self.placed.values() if p.rank == r)
            assert self.policy.promised(r) == {None: want}

    # ------------------------------------------------------------------ the recount

    def _holder(self, key: bytes) -> int | None:
        """The rank the newest sending of `key` went to, while that sending is kept."""
        for s in reversed(self.sendings):
            if key in s.keys:
                kept = not s.released and s.at_s >= self.now_s - TTL_S
                return s.rank if kept else None
        return None

    def _expected(self, keys: list[bytes], P: int, need: int) -> tuple[int, int] | None:
        room = {r: TOTAL - self.committed[r] - self._reserved(r) for r in range(WORLD)}
        fits = [r for r in range(WORLD) if room[r] >= need]
        if not fits:
            return None
        gpu, total = oracle(self.gpu, self.host, WORLD, self.windows, keys, P)
        reusable = (P - 1) // B
        first = self._holder(keys[0]) if keys and reusable > 0 else None
        if first is not None and gpu[first] < reusable:
            run = 0
            while run < reusable and self._holder(keys[run]) == first:
                run += 1
            if run > gpu[first]:
                gpu[first] = max(gpu[first], run)
                total[first] = max(total[first], run)
        w, c = self.weights.overlap_weight, self.weights.onboard_cost
        blocks = -(-P // B)

        def cost(r: int) -> float:
            prefill = blocks - gpu[r] - (1 - c) * (total[r] - gpu[r])
            active = self.committed[r] + self._reserved(r) + blocks - gpu[r]
            return w * prefill + active

        lowest = min(cost(r) for r in fits)
        tied = [r for r in fits if cost(r) <= lowest + 1e-9 * (1 + abs(lowest))]
        best = min(tied, key=lambda r: (-room[r], r))
        return best, total[best]

    def _reserved(self, rank: int) -> int:
        return sum(p.blocks for p in self.placed.values() if p.rank == rank)


class PreciseRoutingWithASlidingWindow(PreciseRouting):
    windows: ClassVar[dict[int, Window]] = {0: None, 1: 3 * B + 1}  # Match's arrays path


PreciseRouting.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
PreciseRoutingWithASlidingWindow.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
TestPreciseRouting = PreciseRouting.TestCase
TestPreciseRoutingWithASlidingWindow = PreciseRoutingWithASlidingWindow.TestCase
