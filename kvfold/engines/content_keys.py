"""An engine's blocks keyed by kvfold's own prefix keys, never by the engine's hashes.
Pure; no Ray.

An engine's block hash depends on its hash algorithm and seed (vLLM's sha256 over a
pickle, a per-process seed for Python's hash, SGLang's and TensorRT-LLM's own), so a
router that keys prompts itself scores 0 against it unless both agree exactly (the
commonest way KV routers go quietly blind). kvfold keys each stored block the way it
keys a prompt (kvfold.worker.hashing: a SHA-256 chain over the token ids from the first
block), from the tokens the event carries and the state of its parent's chain:

    engine hash h_i  ->  (content key k_i, the chain's running hash after block i)
    k_i = digest(chain(parent) + tokens of block i [+ its extra keys])

So one prompt meets the same keys on every engine of the same block size, and on
kvfold's own ranks. A block that cannot be keyed (no tokens, or a parent this table
never saw: a gap, or blocks stored before kvfold was listening) is counted as unkeyed
and never credited; its children are unkeyed too.

Extra keys (LoRA, cache salt, multimodal inputs) are folded into the chain, so such
blocks never meet a plain prompt's keys: no false credit, at the price of no credit for
a router that does not fold the same extras.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvfold.engines.vllm_wire import EngineHash, EngineStored
from kvfold.worker.hashing import Hasher, new_hasher

_EXTRA = b"\0kvfold-extra\0"


@dataclass(slots=True)
class ContentKeys:
    """Per (window group, engine hash): the content key and its chain's running hash, or
    None for a block that could not be keyed. Owned by one engine source."""

    table: dict[tuple[int, EngineHash], tuple[bytes, Hasher] | None] = field(default_factory=dict)
    num_unkeyed: int = 0  # blocks stored that could not be keyed (cumulative)

    def store(self, ev: EngineStored) -> list[bytes | None]:
        """Key the blocks of a BlockStored, in order (None: could not be keyed)."""
        g, size, table = ev.group_idx, ev.block_size, self.table
        if ev.parent_block_hash is None:
            chain: Hasher | None = new_hasher(None)
        else:
            parent = table.get((g, ev.parent_block_hash))
            chain = None if parent is None else parent[1]
        tokens = ev.token_ids
        if not tokens:
            chain = None
        if ev.lora_name is not None and chain is not None:
            chain = chain.copy()
            chain.update(_EXTRA + msgpack.packb(["lora", ev.lora_name]))
        out: list[bytes | None] = []
        data = memoryview(_token_bytes(tokens)) if chain is not None else None
        step = size * 8
        for i, h in enumerate(ev.block_hashes):
            if chain is None or data is None:
                table[(g, h)] = None
                out.append(None)
                self.num_unkeyed += 1
                continue
            chain = chain.copy()
            chain.update(data[i * step : (i + 1) * step])
            extra = ev.extra_keys[i] if ev.extra_keys is not None else None
            if extra is not None:
                chain.update(_EXTRA + _packed(extra))
            key = chain.digest()
            table[(g, h)] = (key, chain)
            out.append(key)
        return out

    def remove(self, group: int, h: EngineHash) -> tuple[bool, bytes | None]:
        """Forget a block: (whether it was known, its content key if it had one)."""
        entry = self.table.pop((group, h), _MISSING)
        if entry is _MISSING:
            return False, None
        return True, None if entry is None else entry[0]

    def clear(self) -> None:
        self.table.clear()

    def __len__(self) -> int:
        return len(self.table)


_MISSING: Any = object()


def _token_bytes(tokens: tuple[int, ...]) -> bytes:
    """Token ids as kvfold's prefix keys hash them: little-endian int64 each."""
    import numpy as np

    return np.asarray(tokens, dtype="<i8").tobytes()


def _packed(value: Any) -> bytes:
    try:
        out: bytes = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError):
        out = repr(value).encode()
    return out


__all__ = ["ContentKeys"]
