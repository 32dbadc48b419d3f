"""What the door answers a request (kvfold.serving.door_actor), and why it refuses one.
Pure; no Ray.

    Admitted        where to send it: the engine's rank and URL, its blocks, how long it waited
    NotAdmitted     why not, with its HTTP status (429 + retry after for a full queue or a
                    deadline passed, 400 for what can never fit, 503 for engines unknown)
    QueueRefused, QueueTimeout   raised inside the door; callers get NotAdmitted
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.errors import KVFoldError


class QueueRefused(KVFoldError, RuntimeError):  # inside the actor; callers get NotAdmitted
    """Not queued: `reason` is exceeds_engine_capacity, prompt_too_long, queue_full,
    duplicate_request_id or released (its release came first)."""

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        self.reason = reason
        self.retry_after_s = retry_after_s
        super().__init__(f"{reason}: {message}")


class QueueTimeout(KVFoldError, TimeoutError):  # inside the actor; callers get NotAdmitted
    """It waited in kvfold's queue for its whole deadline without fitting an engine."""

    def __init__(self, waited_s: float, retry_after_s: float) -> None:
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s
        super().__init__(f"no engine had room within {waited_s:.1f} s")


@dataclass(frozen=True, slots=True)
class NotAdmitted:
    """Why a request was not admitted. `reason`: queue_full and queue_timeout (HTTP 429,
    retry after `retry_after_s`), exceeds_engine_capacity and prompt_too_long (400),
    engines_unknown (503), released (its own release came first), duplicate_request_id."""

    reason: str
    message: str
    retry_after_s: float | None = None

    @property
    def http_status(self) -> int:
        return {"queue_full": 429, "queue_timeout": 429, "engines_unknown": 503,
                "released": 499}.get(self.reason, 400)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Admitted:
    rank: int
    url: str
    need_blocks: int
    held_blocks: int
    waited_s: float
    view_version: int


__all__ = ["Admitted", "NotAdmitted", "QueueRefused", "QueueTimeout"]
