"""kvfold's own errors. Ray failures are translated into these in the shells."""

from __future__ import annotations


class KVFoldError(Exception):
    """Base class of every kvfold error."""


class IntegrityError(KVFoldError, RuntimeError):
    """An invariant broke; the message holds the numbers that failed to balance."""


class ReportError(KVFoldError, ValueError):
    """A report was refused. `reason` is a short code, counted by the receiver."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class AggregatorUnavailable(KVFoldError):
    """The cluster aggregator cannot be reached (not started, restarting, or gone)."""


class NodeUnavailable(KVFoldError):
    """A node's host-KV actor cannot be reached."""

    def __init__(self, node: int, detail: str = "") -> None:
        self.node = node
        super().__init__(f"node {node} is unavailable" + (f": {detail}" if detail else ""))


class RankUnavailable(KVFoldError):
    """A rank actor cannot be reached."""

    def __init__(self, rank: int, detail: str = "") -> None:
        self.rank = rank
        super().__init__(f"rank {rank} is unavailable" + (f": {detail}" if detail else ""))


class DoorRefused(KVFoldError, RuntimeError):
    """The front door did not admit the request; the message says why (NotAdmitted's
    reason). Raised by kvfold's Serve RequestRouter in the handle caller's process.
    `http_status`: what an HTTP ingress answers (429 with `retry_after_s` for a full queue
    or a deadline passed, 400 for a request no engine can take, 503 with no door or no
    engine known yet)."""

    def __init__(
        self, message: str, http_status: int = 503, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, http_status, retry_after_s)  # all three survive pickling
        self.message = message
        self.http_status = http_status
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class PlacementError(KVFoldError):
    """Ray could not place what launch asked for within the timeout."""
