"""Prefix block keys: stable across processes and machines.

    key[i] = sha256(header(salt) + int64_le(tokens[0 : (i+1) * B]))

Each key names the whole prefix up to the end of block i, so equal keys mean
equal prefixes (and equal salts). Computed incrementally: one running SHA-256
state per sequence, copied at each block boundary. Never Python's `hash()`.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from hashlib import sha256
from typing import Any

import numpy as np
import numpy.typing as npt

Hasher = Any  # hashlib's sha256 object (no public type)
TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]


def as_token_array(token_ids: object, name: str = "token_ids") -> npt.NDArray[np.int64]:
    """Validate token ids (non-negative ints; Python bools count as 0/1) as int64.

    Raises TypeError/ValueError naming the argument and what was wrong.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or (token_ids.size and token_ids.dtype.kind not in "iu"):
            raise TypeError(
                f"{name} must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}"
            )
        if token_ids.dtype.kind == "u" and token_ids.size and token_ids.max() > 2**63 - 1:
            raise ValueError(f"{name} must hold ints < 2**63, got {int(token_ids.max())}")
        arr = token_ids.astype(np.int64, copy=False)
    elif isinstance(token_ids, Sequence) and not isinstance(token_ids, (str, bytes)):
        try:
            arr = np.frombuffer(array.array("q", token_ids), dtype=np.int64)
        except TypeError:
            bad = next(t for t in token_ids if not isinstance(t, int))
            raise TypeError(f"{name} must hold ints, got {bad!r} ({type(bad).__name__})") from None
        except OverflowError:
            raise ValueError(f"{name} must hold ints < 2**63") from None
    else:
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name} must hold non-negative ints, got {int(arr.min())}")
    return arr


def new_hasher(salt: str | bytes | None) -> Hasher:
    """The running hash state before block 0; a salt makes a tenant's keys its own."""
    if salt is not None and not isinstance(salt, (str, bytes)):
        raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")
    if isinstance(salt, str):
        salt = salt.encode()
    header = b"kvfold-prefix-v1\0" + (b"\1" + sha256(salt).digest() if salt is not None else b"\0")
    return sha256(header)


def extend_keys(
    hasher: Hasher, tokens: npt.NDArray[np.int64], tokens_per_block: int
) -> list[bytes]:
    """Keys of the full blocks in `tokens`, advancing `hasher` past them."""
    # the tokens' own bytes where they are contiguous little-endian int64 (as_token_array
    # gives that for lists and int64 arrays): no copy
    data = np.ascontiguousarray(tokens, dtype="<i8").data.cast("B")
    step = tokens_per_block * 8
    end = (len(tokens) // tokens_per_block) * step
    out: list[bytes] = []
    append = out.append
    update = hasher.update
    for off in range(0, end, step):
        update(data[off : off + step])
        append(hasher.copy().digest())
    return out


def block_keys(
    token_ids: object, tokens_per_block: int, salt: str | bytes | None = None
) -> list[bytes]:
    """Keys of every full block of a prompt (what a scheduler sends for affinity)."""
    return extend_keys(new_hasher(salt), as_token_array(token_ids), tokens_per_block)
