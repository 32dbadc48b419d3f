"""A node's host-memory KV tier: the pool, its layout check, how blocks travel."""

from kvfold.hosttier.packing import unpack_blocks
from kvfold.hosttier.pool import HostKVPool
from kvfold.hosttier.tier import HostTierServer

__all__ = ["HostKVPool", "HostTierServer", "unpack_blocks"]
