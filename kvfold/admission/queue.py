"""Head-of-line order: strict FIFO.

A scheduler keeps waiting requests in arrival order and asks about them from
the head. ADMIT and REJECT take the head off; QUEUE stops the pass, so no
request overtakes an earlier one. Large requests therefore never starve behind
a stream of small ones, at the price of some utilization while the head waits
(the trade vLLM's and TensorRT-LLM's FCFS schedulers make by default).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from kvfold.admission.decision import AdmissionRequest, Decision, Outcome

T = TypeVar("T")


class FifoAdmissionQueue(Generic[T]):
    def __init__(self, to_request: Callable[[T], AdmissionRequest]) -> None:
        self._items: deque[T] = deque()
        self._to_request = to_request

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def push(self, item: T) -> None:
        self._items.append(item)

    def push_front(self, items: Iterable[T]) -> None:
        """Put items back at the head, keeping their order (e.g. a rank refused them)."""
        self._items.extendleft(reversed(list(items)))

    def pump(self, decide: Callable[[AdmissionRequest], Decision]) -> list[tuple[T, Decision]]:
        """Decide from the head until a QUEUE; return every (item, decision) made,
        the QUEUEd head last (it stays in the queue)."""
        out: list[tuple[T, Decision]] = []
        while self._items:
            item = self._items[0]
            d = decide(self._to_request(item))
            out.append((item, d))
            if d.outcome is Outcome.QUEUE:
                break
            self._items.popleft()
        return out
