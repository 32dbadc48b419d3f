"""AdmissionController(refresh_in_background=True): a thread of the controller's own
refreshes; a decision never waits on the network, and a view not renewed in time makes
decisions queue. Every wait here is on a condition (an Event), never on a sleep."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvfold.admission import AdmissionController, AdmissionRequest, Decision, Outcome
from kvfold.topology import Topology
from kvfold.view import ClusterView
from tests.unit.test_admission import make_view

TOPO = Topology.from_mapping([0, 0, 1])
WAIT_S = 30.0  # a condition not met by then is a failure, however busy the machine


class HeldSource:
    """Views of 3 ranks, a newer one per call; from call `hold_from` on, each call waits
    for `gate` (the network, slow) after saying so in `entered`."""

    def __init__(self, hold_from: int = 2) -> None:
        self.calls = 0
        self.hold_from = hold_from
        self.gate = threading.Event()
        self.entered: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def reached(self, call: int) -> threading.Event:
        with self.lock:
            return self.entered.setdefault(call, threading.Event())

    def __call__(self) -> ClusterView:
        with self.lock:
            self.calls += 1
            call = self.calls
        self.reached(call).set()
        if call >= self.hold_from:
            self.gate.wait()
        return make_view(TOPO, total=100, version=call)


def request(i: int) -> AdmissionRequest:
    return AdmissionRequest(f"r{i}", prompt_tokens=16, max_new_tokens=4)


def decide_within(ctl: AdmissionController, req: AdmissionRequest) -> Decision:
    """ctl.decide(req), from another thread: a decision that waits on the held fetch
    fails the test instead of hanging it."""
    got: list[Decision] = []
    answered = threading.Event()

    def decide() -> None:
        got.append(ctl.decide(req))
        answered.set()

    threading.Thread(target=decide, daemon=True).start()
    assert answered.wait(WAIT_S), "a decision waited on the refresh in flight"
    return got[0]


def held_controller(
    view_timeout_s: float,
) -> tuple[HeldSource, AdmissionController, list[float]]:
    """A controller refreshing in the background from a HeldSource, on a clock the test
    moves (now[0])."""
    now = [0.0]
    source = HeldSource()
    ctl = AdmissionController(
        source,
        refresh_interval_s=0.01,
        refresh_in_background=True,
        view_timeout_s=view_timeout_s,
        clock=lambda: now[0],
        router="least_loaded",
    )
    return source, ctl, now


def test_a_decision_never_waits_on_a_refresh_in_flight() -> None:
    source, ctl, now = held_controller(view_timeout_s=100.0)
    try:
        assert ctl.refreshing_in_background
        assert source.reached(2).wait(WAIT_S)  # the first view is in; the second is held
        now[0] = 5.0  # a refresh is due, by this controller's clock
        for i in range(3):
            d = decide_within(ctl, request(i))
            assert (d.outcome, d.view_version) == (Outcome.ADMIT, 1), d
        assert not source.gate.is_set() and source.calls == 2  # it answered meanwhile
    finally:
        source.gate.set()
        ctl.close()
    assert not ctl.refreshing_in_background
    calls = source.calls
    now[0] = 10.0  # due again: after close() the decision refreshes, as without the thread
    assert ctl.decide(request(9)).outcome is Outcome.ADMIT
    assert source.calls == calls + 1


def test_a_view_not_renewed_in_time_makes_decisions_queue_until_one_is() -> None:
    source, ctl, now = held_controller(view_timeout_s=1.0)
    try:
        assert source.reached(2).wait(WAIT_S)
        assert decide_within(ctl, request(0)).outcome is Outcome.ADMIT
        now[0] = 1.5  # the held fetch has not answered for longer than view_timeout_s
        d = decide_within(ctl, request(1))
        assert (d.outcome, d.reason) == (Outcome.QUEUE, "no_fresh_view")
        source.gate.set()  # the held fetch answers (begun at 0.0: still stale), and the
        assert source.reached(4).wait(WAIT_S)  # third, begun at 1.5, is taken in
        d = decide_within(ctl, request(1))
        assert d.outcome is Outcome.ADMIT and d.view_version >= 2, d
    finally:
        source.gate.set()
        ctl.close()


def test_a_failing_source_queues_in_the_background_too() -> None:
    fail = threading.Event()
    failed = threading.Event()
    answers_since: list[int] = []  # fetches answered since the last failure
    second_answer = threading.Event()  # the first answer after a failure is taken in

    def source() -> ClusterView:
        if fail.is_set():
            answers_since.clear()
            failed.set()
            raise ConnectionError("aggregator unreachable")
        answers_since.append(1)
        if failed.is_set() and len(answers_since) >= 2:
            second_answer.set()
        return make_view(TOPO, total=100, version=time.monotonic_ns())

    fail.set()
    ctl = AdmissionController(  # a view goes stale only by failing: the test is the source's
        source,
        refresh_interval_s=0.01,
        refresh_in_background=True,
        view_timeout_s=1e6,
        router="least_loaded",
    )
    try:
        assert failed.wait(WAIT_S)
        d = ctl.decide(request(0))
        assert (d.outcome, d.reason) == (Outcome.QUEUE, "no_fresh_view")
        assert ctl.view_error is not None and "unreachable" in ctl.view_error
        fail.clear()
        assert second_answer.wait(WAIT_S)
        assert ctl.decide(request(1)).outcome is Outcome.ADMIT
    finally:
        ctl.close()


def test_decisions_and_releases_beside_refreshes_keep_the_books_straight() -> None:
    """A smoke test of the books beside refreshes: decisions and releases on this thread
    while the refresher loads views whose ranks show some of the tickets handed out. What
    the policy counts as promised is, at the end, exactly what its book holds, and each
    rank's room is its lease less that. (The interpreter lock makes a lost update rare
    even without the controller's lock: this guards the bookkeeping, not the locking.)"""
    shown: dict[int, dict[str, int]] = {}
    loads = threading.Semaphore(0)

    def source() -> ClusterView:
        loads.release()
        return make_view(TOPO, total=100, tickets=dict(shown), version=time.monotonic_ns())

    ctl = AdmissionController(
        source,
        refresh_interval_s=0.002,
        refresh_in_background=True,
        controller_id="books",
        router="least_loaded",
    )
    rng = np.random.default_rng(0)
    admitted: list[tuple[str, int, int]] = []
    try:
        for _ in range(40):  # forty views taken in, decisions going on throughout
            assert loads.acquire(timeout=WAIT_S)
            for _ in range(25):
                i = len(admitted) + int(rng.integers(10**9))
                d = ctl.decide(request(i))
                if d.outcome is Outcome.ADMIT:
                    assert d.rank is not None and d.ticket is not None
                    admitted.append((f"r{i}", d.rank, d.ticket.number))
                if admitted and rng.random() < 0.3:
                    ctl.release(admitted.pop(int(rng.integers(len(admitted))))[0])
                if admitted and rng.random() < 0.3:  # a rank shows a ticket: settled
                    _, rank, number = admitted[int(rng.integers(len(admitted)))]
                    shown[rank] = {"books": max(number, shown.get(rank, {}).get("books", 0))}
    finally:
        ctl.close()
    p = ctl.policy
    assert p.index is not None
    assert (p.reserved == p.book.reserved(p.index.windows, p.index.world_size)).all()
    assert (p.room() == p._lease(p.index) - p.reserved).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"refresh_in_background": True, "refresh_interval_s": 0.0}, "refresh_interval_s"),
        ({"view_timeout_s": 0.0}, "view_timeout_s"),
        ({"view_timeout_s": float("nan")}, "view_timeout_s"),
        (
            {"refresh_in_background": True, "refresh_interval_s": 2.0, "view_timeout_s": 2.0},
            "view_timeout_s must be longer than refresh_interval_s",
        ),
    ],
)
def test_bad_background_settings_are_refused_and_start_nothing(
    kwargs: dict[str, object], match: str
) -> None:
    def refreshers() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("kvfold-refresh-")}

    before = refreshers()
    with pytest.raises(ValueError, match=match):
        AdmissionController(HeldSource(), router="least_loaded", **kwargs)  # type: ignore[arg-type]
    assert refreshers() == before


def test_a_controller_dropped_without_close_ends_its_thread() -> None:
    """The refresher holds its controller weakly: dropped, it is collected, and the
    thread ends at its next interval instead of polling the source for ever."""
    source = HeldSource(hold_from=10**9)
    ctl = AdmissionController(
        source, refresh_interval_s=0.01, refresh_in_background=True, router="least_loaded"
    )
    assert source.reached(2).wait(WAIT_S)
    thread = ctl._refresher
    assert thread is not None
    del ctl
    gc.collect()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_wait_for_view_says_when_decisions_can_admit() -> None:
    """Before its first view a controller's decisions queue; wait_for_view says when one
    is in: the thread's first, or (without the thread) a refresh made there and then."""
    source = HeldSource(hold_from=2)
    with AdmissionController(
        source, refresh_interval_s=0.01, refresh_in_background=True, router="least_loaded"
    ) as ctl:
        assert ctl.wait_for_view(WAIT_S)
        assert ctl.decide(request(0)).outcome is Outcome.ADMIT
        source.gate.set()
    inline = AdmissionController(HeldSource(hold_from=10**9), router="least_loaded")
    assert inline.wait_for_view(0.0)  # it refreshed in the call itself

    def unreachable() -> ClusterView:
        raise ConnectionError("aggregator unreachable")

    broken = AdmissionController(unreachable, router="least_loaded")
    assert not broken.wait_for_view(0.0)
    assert broken.view_error is not None and "unreachable" in broken.view_error


def test_a_refresher_left_running_is_stopped_before_any_exit_handler() -> None:
    """A driver that exits without close(): kvfold stops the refresher before the exit
    handlers run, those registered before it started (as Ray's own shutdown is, at
    import) and those registered after (as a cluster started later registers its nodes'),
    so no read is on its way through Ray while they take it down."""
    script = textwrap.dedent(
        """
        import atexit, threading

        def check(when: str) -> None:
            alive = [t.name for t in threading.enumerate() if t.name.startswith("kvfold-")]
            print(f"refreshers at a handler registered {when}:", alive, flush=True)

        atexit.register(check, "before")
        from kvfold.admission import AdmissionController
        from tests.unit.test_background_refresh import HeldSource

        ctl = AdmissionController(HeldSource(hold_from=10**9), refresh_interval_s=0.01,
                                  refresh_in_background=True, router="least_loaded")
        assert ctl.wait_for_view(30) and ctl.refreshing_in_background
        atexit.register(check, "after")
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for when in ("before", "after"):
        assert f"refreshers at a handler registered {when}: []" in done.stdout, done.stdout
