"""Names of kvfold's Ray actors, so any driver can find them."""

from __future__ import annotations

DEFAULT_NAMESPACE = "kvfold"
AGGREGATOR_NAME = "kvfold:aggregator"
PLACEMENT_GROUP_NAME = "kvfold:ranks"
PREFIX = "kvfold:"


def node_actor_name(node: int) -> str:
    return f"kvfold:node:{node}"


def rank_actor_name(rank: int) -> str:
    return f"kvfold:rank:{rank}"
