"""KVFoldClient: find the cluster aggregator by name from any driver and read views.
IndexReplica: a reader's copy of the cluster block index, kept through
kvfold.blockindex.client.IndexClient (who keeps that index: the aggregator, or with racks
each rack its nodes' shard).

Every Ray failure is translated into kvfold's own errors: a missing, dead or
restarting aggregator raises AggregatorUnavailable (never a hang: every call
has a timeout).
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.exceptions import AuthenticationError, GetTimeoutError, RayActorError

from kvfold.admission.capacity import CapacityIndex
from kvfold.admission.claims import Claim, ClaimNote
from kvfold.aggregator.capacity_delta import CapacityReader
from kvfold.aggregator.view_delta import ViewReader
from kvfold.blockindex.client import IndexClient, sum_index_counts
from kvfold.blockindex.feed import Replica
from kvfold.blockindex.prompt_match import PromptMatch, match_prompt
from kvfold.errors import AggregatorUnavailable, NodeUnavailable, RankUnavailable
from kvfold.kvevents.events import HOST, RANK, BlockHash
from kvfold.naming import AGGREGATOR_NAME, DEFAULT_NAMESPACE, node_actor_name, rank_actor_name
from kvfold.view import ClusterView, RankSummary, SourceState


def connect(address: str | None = None, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Join a running Ray cluster as a driver (no-op if this process already has)."""
    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=addr, namespace=namespace, log_to_driver=False)
    except AuthenticationError as e:
        raise AggregatorUnavailable(
            f"the Ray cluster at {addr!r} refused this client: it needs the cluster's auth "
            "token (--auth-token-file PATH; docs/security.md)"
        ) from e
    except ConnectionError as e:
        hint = (
            ""
            if os.environ.get("RAY_AUTH_MODE") == "token"
            else "; if it runs with token auth (every embedded cluster does), it refused "
            "this client: pass --auth-token-file PATH (docs/security.md)"
        )
        raise AggregatorUnavailable(
            f"no Ray cluster at {addr!r}: {e}. Start one with `kvfold demo` or `kvfold up`, "
            f"or pass --address HOST:PORT{hint}"
        ) from e


class KVFoldClient:
    def __init__(
        self,
        address: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = 5.0,
    ) -> None:
        connect(address, namespace)
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._handle: Any = None
        self._reader = ViewReader()  # the last view, rebuilt from deltas
        self._capacity: dict[str, CapacityReader] = {}  # per controller id
        self._index = IndexClient(namespace, timeout_s)  # who keeps the block index

    def _aggregator(self) -> Any:
        if self._handle is None:
            try:
                self._handle = ray.get_actor(AGGREGATOR_NAME, namespace=self.namespace)
            except ValueError as e:
                raise AggregatorUnavailable(
                    f"no kvfold aggregator in namespace {self.namespace!r}; "
                    "start one with `kvfold up` (or `kvfold demo`)"
                ) from e
        return self._handle

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            ref = getattr(self._aggregator(), method).remote(*args)
            return ray.get(ref, timeout=timeout)
        except RayActorError as e:
            self._handle = None  # re-resolve next time: it may come back under the same name
            raise AggregatorUnavailable(f"the kvfold aggregator is down or restarting: {e}") from e
        except GetTimeoutError as e:
            raise AggregatorUnavailable(
                f"the kvfold aggregator did not answer {method} within {timeout} s"
            ) from e

    def view(self) -> ClusterView:
        """The current view. Only what changed since this client's last view travels and
        is decoded (kvfold.aggregator.view_delta)."""
        while True:
            asked = self._reader.position
            view = self._reader.apply(self._call("view_since", asked), asked)
            if view is not None:
                return view

    def capacity(self, controller_id: str) -> CapacityIndex:
        """The current view's capacity as `controller_id` reads it (its own tickets): what
        an AdmissionController refreshes from. Only the rows of nodes whose capacity
        changed travel (kvfold.aggregator.capacity_delta)."""
        reader = self._capacity.setdefault(controller_id, CapacityReader())
        while True:
            asked = reader.position
            index = reader.apply(self._call("capacity_since", asked, controller_id), asked)
            if index is not None:
                return index

    def exchange_claims(self, controller_id: str, note: ClaimNote) -> tuple[Claim, ...]:
        """A controller's note to the aggregator's claim desk, and the board it answers
        (kvfold.admission.claims): what AdmissionController exchanges at each refresh
        when controllers share ranks."""
        board: tuple[Claim, ...] = self._call("exchange_claims", controller_id, note)
        return board

    def version(self) -> int:
        version: int = self._call("version")
        return version

    def wait_for_version(self, version: int, timeout_s: float = 5.0) -> ClusterView | None:
        """The first view newer than `version`, or None when none came within `timeout_s`."""
        asked = self._reader.position
        data = self._call("wait_for_version", version, timeout_s, asked, timeout_s=timeout_s + 5.0)
        if data is None and asked[1] <= version:
            return None  # timed out (a reader already past `version` is answered at once)
        view = self._reader.apply(data, asked)
        return view if view is not None and view.version > version else self.view()

    def rank(self, rank: int) -> tuple[RankSummary, SourceState] | None:
        """A rank's last summary and its node's state (drill-down), from the current view."""
        return self.view().rank_summary(rank)

    def metrics_url(self) -> str | None:
        """Where the aggregator serves Prometheus metrics (None when not enabled)."""
        url: str | None = self._call("metrics_url")
        return url

    def report_admission(self, scheduler: str, counts: dict[str, int]) -> None:
        """Publish a scheduler's cumulative admission decision counts ('outcome:reason')."""
        self._call("report_admission", scheduler, counts)

    def block_index_since(self, cursor: Any) -> tuple[Any, list[Any], bool]:
        """The cluster block index's ops after `cursor` (kvfold.blockindex.feed), for a
        replica: (cursor now, ops, whole: the ops rebuild it from empty). From the
        aggregator, or from every rack's index shard (kvfold.blockindex.client.IndexClient)."""
        return self._index.since(cursor)

    def block_index_counts(self) -> dict[str, Any]:
        """The index's counts (kvfold.blockindex.feed), summed over its shards."""
        if not self._index.sharded():
            counts: dict[str, Any] = self._call("block_index_counts")
            return counts
        return sum_index_counts(
            [self._index.ask(name, "block_index_counts") for name, _ in self._index.shards()]
        )

    def counts(self) -> dict[str, Any]:
        counts: dict[str, Any] = self._call("counts")
        return counts

    # ------------------------------------------------------------ what is held

    def held_keys(self, rank: int) -> dict[int, frozenset[BlockHash]]:
        """The prefix keys `rank`'s GPU cache could reuse now, per window group (asked of
        the rank itself). Raises RankUnavailable when it does not answer."""
        name = rank_actor_name(self._check(rank, "rank"))
        keys = self._ask_source(
            name, "reusable_keys", RankUnavailable(rank, f"{name} did not answer")
        )
        return {int(g): frozenset(ks) for g, ks in keys.items() if ks}

    def host_keys(self, node: int) -> dict[int, frozenset[BlockHash]]:
        """The prefix keys `node`'s host tier holds now, per window group (asked of its
        host-KV actor). Raises NodeUnavailable when it does not answer."""
        name = node_actor_name(self._check(node, "node"))
        keys = self._ask_source(name, "host_keys", NodeUnavailable(node, f"{name} did not answer"))
        return {int(g): frozenset(ks) for g, ks in keys.items() if ks}

    def indexed_keys(self, kind: str, source: int) -> dict[int, frozenset[BlockHash]]:
        """What the aggregator's block index holds for one source, per window group:
        kind "rank" (a rank's GPU) or "host" (a node's host tier)."""
        if kind not in (RANK, HOST):
            raise ValueError(f"kind must be {RANK!r} or {HOST!r}, got {kind!r}")
        i = self._check(source, kind)
        if not self._index.sharded():
            keys = self._call("block_keys", kind, i)
        else:
            node = i if kind == HOST else self.view().rank_to_node[i]
            keys = self._index.ask(self._index.keeper(node), "block_keys", kind, i)
        return {int(g): frozenset(ks) for g, ks in keys.items() if ks}

    def index(self) -> IndexReplica:
        """A read-only replica of the cluster block index, brought up to date now; call
        its `refresh()` to follow the index, `match(prompt_tokens)` to ask it."""
        replica = IndexReplica(self)
        replica.refresh()
        return replica

    def _check(self, i: int, what: str) -> int:
        limit = self._limits().get(what)
        if type(i) is not int or i < 0 or (limit is not None and i >= limit):
            allowed = "a non-negative int" if limit is None else f"0..{limit - 1}"
            raise ValueError(f"{what} must be {allowed}, got {i!r}")
        return i

    def _limits(self) -> dict[str, int]:
        view = self._reader.view or self.view()
        return {"rank": view.world_size, "node": view.num_nodes, HOST: view.num_nodes,
                RANK: view.world_size}  # fmt: skip

    def _ask_source(self, name: str, method: str, unavailable: Exception) -> Any:
        try:
            handle = ray.get_actor(name, namespace=self.namespace)
            return ray.get(getattr(handle, method).remote(), timeout=self.timeout_s)
        except (ValueError, RayActorError, GetTimeoutError) as e:
            raise unavailable from e


class IndexReplica:
    """A controller's kind of copy of the cluster block index, for users and tools: it
    follows the aggregator's op log (kvfold.blockindex.feed.Replica) and answers what a
    prompt would find on each rank and node (kvfold.blockindex.prompt_match)."""

    def __init__(self, client: KVFoldClient) -> None:
        self._client = client
        self._replica = Replica(list(client.view().rank_to_node))

    def refresh(self) -> None:
        """Take the ops the aggregator logged since this replica's last refresh."""
        cursor, ops, whole = self._client.block_index_since(self._replica.cursor)
        self._replica.take(cursor, ops, whole)

    def keys(self, kind: str, source: int) -> dict[int, frozenset[BlockHash]]:
        """What this replica holds for one source ("rank" or "host"), per window group."""
        if kind not in (RANK, HOST):
            raise ValueError(f"kind must be {RANK!r} or {HOST!r}, got {kind!r}")
        return {g: frozenset(ks) for g, ks in self._replica.index.keys_of((kind, source)).items()}

    def match(self, prompt_tokens: object, salt: str | bytes | None = None) -> PromptMatch:
        """Per rank and node, what this replica says they hold of a prompt (token ids;
        `salt`: the tenant's, as the ranks were given), in blocks from its first."""
        return match_prompt(self._replica.index, prompt_tokens, salt)
