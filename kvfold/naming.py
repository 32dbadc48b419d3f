"""Names of kvfold's Ray actors, so any driver can find them."""

from __future__ import annotations

DEFAULT_NAMESPACE = "kvfold"
PREFIX = "kvfold:"
AGGREGATOR_NAME = f"{PREFIX}aggregator"
PLACEMENT_GROUP_NAME = f"{PREFIX}ranks"


def node_actor_name(node: int) -> str:
    return f"{PREFIX}node:{node}"


def rack_actor_name(rack: int) -> str:
    return f"{PREFIX}rack:{rack}"


def rank_actor_name(rank: int) -> str:
    return f"{PREFIX}rank:{rank}"
