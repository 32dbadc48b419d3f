"""AdmissionController: what a scheduler embeds. Thread-safe; views from any source.

    controller = AdmissionController(client)          # .capacity(id) or .view(), or a callable
    d = controller.decide(AdmissionRequest("r1", prompt_tokens=900, max_new_tokens=128))
    if d.outcome is Outcome.ADMIT:                    # place it on d.rank, with what it promised
        rank.add_sequence("r1", prompt, max_new_tokens=128, policy=d.policy, ticket=d.ticket)
    ... if it is never placed (cancelled, refused): controller.release("r1")

Views are refreshed at most every `refresh_interval_s`: by the decision that finds the
last one due (it waits on the network then), or, with `refresh_in_background=True`, by a
thread of the controller's own, so that a decision never waits on the network; a view
not renewed within `view_timeout_s` then makes decisions QUEUE (`no_fresh_view`), as a
failed fetch does. `close()` stops that thread.

A source with `.capacity(controller_id)` (KVFoldClient) is read for the view's capacity
alone, as deltas of a few numbers per rank (kvfold.aggregator.capacity_delta); any other
for whole ClusterViews. A view source that fails in any way, or answers with something
that is not a ClusterView (or CapacityIndex), makes decisions QUEUE with reason
`no_fresh_view`. Decisions are counted by outcome and reason.

Controllers sharing ranks (`num_controllers` > 1) exchange a note with the source's
claim desk (`exchange_claims`, as KVFoldClient has; or `claim_source`) at every refresh,
before the view: a request larger than every lease then waits for a claim on one rank
instead of taking a room others may promise too (kvfold.admission.claims); `claims=False`
keeps the older overflow. A failed exchange is a failed refresh.

Routing (kvfold.admission.routing): `precise_prefix` by default where the source also
serves the cluster block index (`block_index_since`, as KVFoldClient does): the
controller keeps a replica of it, brought up to date at each refresh; a failing index
source leaves the replica as it was (routing is a preference, never a promise) and
says why in `index_error`. Elsewhere `approx_prefix`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvfold.admission.capacity import CapacityIndex
from kvfold.admission.claims import Claim, ClaimNote
from kvfold.admission.decision import AdmissionRequest, Decision, Outcome, Policy
from kvfold.admission.policy import AdmissionPolicy
from kvfold.admission.refresher import start_refresher
from kvfold.admission.routing import Router, RoutingWeights, as_router
from kvfold.blockindex.feed import NO_CURSOR, Cursor, Replica
from kvfold.checks import check_positive
from kvfold.view import ClusterView

IndexSource = Callable[[Cursor], tuple[Cursor, list[Any], bool]]
ClaimSource = Callable[[str, ClaimNote], tuple[Claim, ...]]


class AdmissionController:
    def __init__(
        self,
        view_source: Any,
        policy: Policy = Policy.GUARANTEED_NO_EVICT,
        watermark_blocks: int = 0,
        no_fresh: Outcome = Outcome.QUEUE,
        reservation_ttl_s: float = 30.0,
        refresh_interval_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        controller_id: str | None = None,
        num_controllers: int = 1,
        router: Router | str | None = None,
        index_source: IndexSource | None = None,
        weights: RoutingWeights | None = None,
        refresh_in_background: bool = False,
        view_timeout_s: float | None = None,
        claims: bool = True,
        claim_source: ClaimSource | None = None,
    ) -> None:
        """`controller_id`: unique per controller and start (generated when None);
        `num_controllers`: how many controllers, this one included, admit into the same
        ranks (each promises from its lease of every rank's room; docs/admission.md);
        `router`: a Router or its name (None: precise_prefix where there is an index
        source, else approx_prefix); `index_source(cursor)`: the block index's ops after
        a cursor (default: the view source's `block_index_since`, if it has one);
        `refresh_in_background`: refresh in a thread of its own (needs a
        refresh_interval_s > 0), and QUEUE once the view is older than `view_timeout_s`
        (default: 10 intervals, at least 1 s); `claims`: exchange with a claim desk
        when controllers share ranks (`claim_source(controller_id, note)`, default the
        view source's `exchange_claims` where it has one)."""
        self._capacity: Callable[[str], CapacityIndex] | None = None
        if callable(view_source):
            self._fetch: Callable[[], ClusterView] = view_source
        elif hasattr(view_source, "view"):
            self._fetch = view_source.view
            self._capacity = getattr(view_source, "capacity", None)  # KVFoldClient's
        else:
            raise TypeError(
                f"view_source must have .view() or be callable, got {type(view_source).__name__}"
            )
        if index_source is None and not callable(view_source):
            index_source = getattr(view_source, "block_index_since", None)
        chosen = as_router(router) if router is not None else None
        if chosen is None:
            chosen = Router.APPROX_PREFIX if index_source is None else Router.PRECISE_PREFIX
        if chosen is Router.PRECISE_PREFIX and index_source is None:
            raise ValueError(
                "router precise_prefix needs the cluster block index: pass index_source, "
                "or a view source with block_index_since (KVFoldClient)"
            )
        self._index_source = index_source if chosen is Router.PRECISE_PREFIX else None
        self.index_error: str | None = None  # why the last index update failed
        if claim_source is None and not callable(view_source):
            claim_source = getattr(view_source, "exchange_claims", None)
        if not claims or num_controllers == 1:
            claim_source = None
        self._claims = claim_source
        self.policy = AdmissionPolicy(
            policy,
            watermark_blocks,
            reservation_ttl_s,
            no_fresh,
            controller_id=controller_id,
            num_controllers=num_controllers,
            router=chosen,
            weights=weights,
            claims=claim_source is not None,
        )
        self.router = chosen
        self.controller_id = self.policy.controller_id
        self.refresh_interval_s = refresh_interval_s
        self.clock = clock
        self.lock = threading.Lock()  # the policy's
        self._fetching = threading.Lock()  # one refresh at a time: the source's readers
        self.decisions: Counter[tuple[str, str]] = Counter()
        self._last_refresh_s = float("-inf")
        self._loaded_s = float("-inf")  # when the newest view was taken in (self.clock)
        self.view_error: str | None = None  # why the last fetch failed; None: it did not
        if view_timeout_s is None:
            view_timeout_s = max(1.0, 10 * refresh_interval_s)
        check_positive("view_timeout_s", view_timeout_s)
        self.view_timeout_s = view_timeout_s
        self._stop = threading.Event()
        self._first_view = threading.Event()  # set once any view is taken in
        self._refresher: threading.Thread | None = None
        if refresh_in_background:
            check_positive("refresh_interval_s", refresh_interval_s)
            if view_timeout_s <= refresh_interval_s:
                raise ValueError(
                    f"view_timeout_s must be longer than refresh_interval_s "
                    f"({refresh_interval_s!r}) when refreshing in the background, "
                    f"got {view_timeout_s!r}: every view would be stale before the next"
                )
            self._refresher = start_refresher(
                self, self._stop, refresh_interval_s, f"kvfold-refresh-{self.controller_id}"
            )

    @property
    def refreshing_in_background(self) -> bool:
        """Whether a thread of this controller's own is refreshing its view now."""
        return self._refresher is not None and self._refresher.is_alive()

    @property
    def refresh_due(self) -> bool:
        """Whether this controller's next decision refreshes before it decides (in line:
        once refresh_interval_s has passed since the last refresh)."""
        return self._refresher is None and (
            self.clock() - self._last_refresh_s >= self.refresh_interval_s
        )

    def wait_for_view(self, timeout_s: float) -> bool:
        """Whether a view is taken in within `timeout_s` (without the background thread,
        this refreshes now if none is). Decisions before the first view QUEUE."""
        if not self._first_view.is_set() and self._refresher is None:
            self.refresh(force=True)
        return self._first_view.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop refreshing in the background: wait up to `timeout_s` for a refresh in
        flight (a source stuck on the network is left to finish on its own). From then
        on the controller refreshes as one without the thread does, in its decisions."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout_s)
            self._refresher = None

    def __enter__(self) -> AdmissionController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh(self, force: bool = False) -> None:
        """Fetch a view now (or if the last one is older than refresh_interval_s)."""
        now = self.clock()
        if not force and now - self._last_refresh_s < self.refresh_interval_s:
            return
        with self._fetching:
            now = self.clock()  # another caller may have refreshed while this one waited
            if not force and now - self._last_refresh_s < self.refresh_interval_s:
                return
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        self._last_refresh_s = now
        got: ClusterView | CapacityIndex
        want = ClusterView if self._capacity is None else CapacityIndex
        board: tuple[Claim, ...] | None = None
        try:
            if self._claims is not None:  # the board first: the view then shows what ended
                with self.lock:
                    note = self.policy.claim_note(self._hold_s(), self.clock())
                board = self._claims(self.controller_id, note)
                if not isinstance(board, tuple) or not all(isinstance(c, Claim) for c in board):
                    raise TypeError(f"the claim desk gave a {type(board).__name__}, not claims")
            got = self._fetch() if self._capacity is None else self._capacity(self.controller_id)
            if not isinstance(got, want):
                gave = type(got).__name__
                raise TypeError(f"the view source gave a {gave}, not a {want.__name__}")
        except Exception as e:  # any failure of the source: no fresh view, never a guess
            self.view_error = f"{type(e).__name__}: {e}"[:300]
            return
        self.view_error = None
        with self.lock:
            if isinstance(got, CapacityIndex):
                self.policy.load_capacity(got, self.clock())
            else:
                self.policy.load_view(got, self.clock())
            if board is not None:
                self.policy.load_claims(board)
            self._loaded_s = now  # its age counts from when the fetch began
        if self._index_source is not None:
            self._update_index(got.rank_to_node)
        self._first_view.set()  # with the index brought up to date (or its error said)

    def _hold_s(self) -> float:
        """The longest this controller decides on one view: in line, a decision
        refreshes once the interval is past; in the background, view_timeout_s."""
        return max(self.view_timeout_s, self.refresh_interval_s)

    def _update_index(self, rank_to_node: tuple[int, ...]) -> None:
        replica = self.policy.blocks
        if replica is None or replica.rank_to_node != list(rank_to_node):
            replica = Replica(list(rank_to_node))
        assert self._index_source is not None
        asked = replica.cursor
        try:
            cursor, ops, whole = self._index_source(asked)
        except Exception as e:  # the replica stays as it was; routing is only a preference
            self.index_error = f"{type(e).__name__}: {e}"[:300]
            return
        with self.lock:
            if replica.cursor != asked:  # another refresh got there first: newer
                return
            try:
                replica.take(cursor, ops, whole)
            except (ValueError, TypeError, KeyError, IndexError) as e:
                replica.cursor = NO_CURSOR  # half applied: rebuilt whole next time
                self.index_error = f"{type(e).__name__}: {e}"[:300]
                return
            self.index_error = None
            self.policy.blocks = replica

    def load_view(self, view: ClusterView) -> None:
        """Take `view` now, as a refresh would (the source is not asked)."""
        with self.lock:
            now = self.clock()
            self.policy.load_view(view, now)
            self._loaded_s = now
            self._first_view.set()

    def decide(self, request: AdmissionRequest) -> Decision:
        background = self._refresher is not None
        if not background:
            self.refresh()
        with self.lock:
            if self.view_error is not None or (
                background and self.clock() - self._loaded_s > self.view_timeout_s
            ):
                version = self.policy.index.version if self.policy.index else 0
                d = Decision(Outcome.QUEUE, "no_fresh_view", version)
            else:
                d = self.policy.decide(request, self.clock())
            self.decisions[(d.outcome.value, d.reason)] += 1
        return d

    def release(self, request_id: str) -> bool:
        with self.lock:
            return self.policy.release(request_id)
