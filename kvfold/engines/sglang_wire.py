"""SGLang's KV events as they come off its ZMQ publisher, decoded strictly into the same
EngineBatch / EngineEvent types as vLLM's (kvfold.engines.vllm_wire). Pure; no Ray, no
sockets (the shell hands frames in).

SGLang's publisher (python/sglang/srt/disaggregation/kv_events.py) follows vLLM's design;
what differs is below.

    live     [topic, seq (8 bytes, big-endian, from 0), payload]
    replay   [b"", seq, payload] ... then [b"", ff * 8, b""]     (no topic frame: its ROUTER
             answers a DEALER that sent [b"", start_seq as 8 bytes])
    payload  [ts, [event, ...], attn_dp_rank]      (msgpack; SGLang before attention-DP
                                                    sent [ts, [event, ...]])
    event    a tagged map (SGLang since HiCache's tiers):
               {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": h | nil,
                "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU",
                ["cache_salt": s], ["session_id": s], ["component_type": "full"],
                ["metadata": {"cache_salt": s}]}
               {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": m}
               {"type": "AllBlocksCleared"}
             or the positional arrays of earlier SGLang (msgspec array_like, the tag first):
               ["BlockStored", hashes, parent, token_ids, block_size, lora_id(, medium)
                (, {"cache_salt": s})]
               ["BlockRemoved", hashes(, medium)]
               ["AllBlocksCleared"]

What kvfold makes of it:

  - medium: "GPU" is the device pool; "CPU_PINNED" (HiCache's host pool, L2) is read as
    kvfold's host tier "CPU"; "DISK" / "EXTERNAL" stay as sent (no source takes them).
    No medium (SGLang before HiCache events) is "GPU".
  - hashes: signed 64-bit ints (SGLang's hash_str_to_int64 of a SHA-256 page chain, or
    Python's hash() of a page's tokens in early releases). Early releases gave a root
    node's first page the parent hash(()) (the empty root key); that constant is read as
    "no parent". Their hashes are content-only: two equal pages at different depths share
    one hash, which no decoder can tell apart (kvfold may then keep one of them too long).
  - block_size is the page's own token count (a node's last page may be short); SGLang's
    default page size is 1, so an event may describe a single token.
  - token_ids of EAGLE bigram pages are pairs: the blocks are decoded without tokens
    (kvfold cannot key them: counted, never credited).
  - cache_salt and lora_id become per-block extra keys, so such blocks never meet a plain
    prompt's keys.
  - component_type (hybrid models): "full" is window group 0, "swa" group 1, "mamba" group
    2 with its tokens dropped (a mamba checkpoint is one leaf state, not a prefix chain).

Anything wrong raises WireError with a short reason (counted by the caller). take_live and
take_replay at the end feed an EngineSource (its own take_live / take_replay read vLLM's
payloads).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfold.engines.vllm_wire import (
    END_SEQ,
    MAX_HASHES,
    MAX_TOKEN_ID,
    EngineBatch,
    EngineCleared,
    EngineEvent,
    EngineHash,
    EngineRemoved,
    EngineStored,
    WireError,
    check_hash,
    check_hashes,
    check_int,
    check_medium,
    frame_count,
    replay_request,
    seq_of,
    unpack_batch,
)

if TYPE_CHECKING:
    from kvfold.engines.engine_source import EngineSource
    from kvfold.kvevents.events import Event

ROOT_PARENT_HASH = 5740354900026072187  # hash(()) in CPython >= 3.8: early SGLang's root
MEDIUMS = {"GPU": "GPU", "CPU_PINNED": "CPU", "CPU": "CPU"}
COMPONENT_GROUPS = {"full": 0, "swa": 1, "mamba": 2}
_STORED_TAGS = frozenset(
    {
        "BlockStored",
        "BlockStoredWithMetadata",
        "BlockStoredWithComponentType",
        "BlockStoredWithComponentTypeAndMetadata",
    }
)
_REMOVED_TAGS = frozenset({"BlockRemoved", "BlockRemovedWithComponentType"})
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


# ------------------------------------------------------------------ frames


def decode_live(frames: list[bytes]) -> EngineBatch:
    """One message of the live stream: [topic, seq, payload]."""
    if not isinstance(frames, list) or len(frames) != 3:
        raise WireError("bad_frame", f"a live message has 3 frames, got {frame_count(frames)}")
    return decode_payload(seq_of(frames[1]), frames[2])


def decode_replay(frames: list[bytes]) -> EngineBatch | None:
    """One message of a replay answer, [b"", seq, payload]: a batch, or None for the end
    marker [b"", ff * 8, b""]."""
    if not isinstance(frames, list) or len(frames) != 3 or frames[0] != b"":
        raise WireError("bad_frame", f"an SGLang replay message is [b'', seq, payload], got "
                        f"{frame_count(frames)} frames")  # fmt: skip
    seq = seq_of(frames[1])
    if seq == END_SEQ:
        return None
    return decode_payload(seq, frames[2])


# ------------------------------------------------------------------ payload


def decode_payload(seq: int, payload: Any) -> EngineBatch:
    ts, raw, dp = unpack_batch(payload, "attn_dp_rank")
    return EngineBatch(seq, ts, _merged(_event(e) for e in raw), dp)


def _merged(events: Iterable[EngineEvent]) -> tuple[EngineEvent, ...]:
    """The events in order, a run of EngineRemoved of one group and medium as one (SGLang
    sends a BlockRemoved per page)."""
    out: list[EngineEvent] = []
    run: list[EngineHash] = []
    run_key = (0, "GPU")
    for ev in events:
        if type(ev) is EngineRemoved:
            key = (ev.group_idx, ev.medium)
            if run and key != run_key:
                out.append(EngineRemoved(tuple(run), *run_key))
                run = []
            run_key = key
            run += ev.block_hashes
            continue
        if run:
            out.append(EngineRemoved(tuple(run), *run_key))
            run = []
        out.append(ev)
    if run:
        if len(run) > MAX_HASHES:
            raise WireError("too_large", f"{len(run)} blocks removed in one batch > {MAX_HASHES}")
        out.append(EngineRemoved(tuple(run), *run_key))
    return tuple(out)


def _event(item: Any) -> EngineEvent:
    if isinstance(item, list):
        item = _from_positional(item)
    if not isinstance(item, dict):
        raise WireError("bad_event", f"an event must be a map or an array, not "
                        f"{type(item).__name__}")  # fmt: skip
    kind = item.get("type")
    if kind in _STORED_TAGS:
        return _stored(item)
    if kind in _REMOVED_TAGS:
        group, _ = _component(item)
        return EngineRemoved(
            check_hashes(item.get("block_hashes"), "BlockRemoved.block_hashes"),
            group,
            _medium(item.get("medium")),
        )
    if kind == "AllBlocksCleared":
        return EngineCleared()
    raise WireError("unknown_event", f"unknown event type {str(kind)[:40]!r}")


def _from_positional(item: list[Any]) -> dict[Any, Any]:
    """An array_like event as a map. After the declared fields come optional ones that
    later SGLang appended (omitted while at their default): a str is the medium, a map
    the typed metadata ({"cache_salt": s})."""
    tag = item[0] if item else None
    names = _POSITIONAL.get(tag) if isinstance(tag, str) else None
    if names is None:
        raise WireError("unknown_event", f"unknown event type {str(tag)[:40]!r}")
    fields = item[1:]
    if len(fields) < len(names):
        raise WireError("bad_event", f"{tag} has {len(fields)} fields, needs {len(names)}")
    out: dict[Any, Any] = {"type": tag, **dict(zip(names, fields, strict=False))}
    for extra in fields[len(names) :]:
        if extra is None:
            continue
        if isinstance(extra, str) and "medium" not in out:
            out["medium"] = extra
        elif isinstance(extra, dict) and tag == "BlockStored" and "metadata" not in out:
            out["metadata"] = extra
        else:
            raise WireError("bad_event", f"{tag}: unexpected trailing field {str(extra)[:40]!r}")
    return out


def _stored(m: dict[Any, Any]) -> EngineStored:
    hashes = check_hashes(m.get("block_hashes"), "BlockStored.block_hashes")
    n = len(hashes)
    size = check_int(m.get("block_size"), "BlockStored.block_size", 1)
    tokens = _tokens(m.get("token_ids"), size * n)
    parent_raw = m.get("parent_block_hash")
    parent = None if parent_raw is None else check_hash(parent_raw, "parent_block_hash")
    if parent == ROOT_PARENT_HASH:
        parent = None
    group, drop_tokens = _component(m)
    extra: list[Any] = []
    lora = m.get("lora_id")
    if lora is not None:
        extra.append(("sglang-lora", check_int(lora, "BlockStored.lora_id")))
    salt = m.get("cache_salt")
    metadata = m.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise WireError("bad_field", "BlockStored.metadata must be a map")
        salt = metadata.get("cache_salt", salt)
    if salt is not None:
        if not isinstance(salt, str) or len(salt) > 1024:
            raise WireError("bad_field", "BlockStored.cache_salt must be a str")
        extra.append(("sglang-cache-salt", salt))
    return EngineStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=() if drop_tokens else tokens,
        block_size=size,
        group_idx=group,
        medium=_medium(m.get("medium")),
        extra_keys=(tuple(extra),) * n if extra else None,
    )


def _tokens(value: Any, want: int) -> tuple[int, ...]:
    """Token ids, one per position: ints, or EAGLE bigram pairs (kept as no tokens).
    Checked at C speed (a coalesced event carries many pages)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise WireError("bad_field", "BlockStored.token_ids must be a list of token ids")
    if len(value) != want:
        raise WireError("bad_field", f"BlockStored.token_ids has {len(value)} entries, the "
                        f"blocks hold {want}")  # fmt: skip
    try:
        arr = np.array(value)
    except (ValueError, TypeError, OverflowError):
        arr = None
    if (
        arr is None
        or arr.dtype.kind not in "iu"
        or arr.ndim not in (1, 2)
        or (arr.ndim == 2 and arr.shape[1] != 2)
        or int(arr.min()) < 0
        or int(arr.max()) >= MAX_TOKEN_ID
    ):
        raise WireError("bad_field", "BlockStored.token_ids must be token ids or id pairs")
    if arr.ndim == 2:
        return ()  # EAGLE bigram pages: not kvfold's tokens
    return tuple(value)


def _component(m: dict[Any, Any]) -> tuple[int, bool]:
    """(window group, whether the tokens are not a prefix chain)."""
    kind = m.get("component_type")
    if kind is None:
        return 0, False
    group = COMPONENT_GROUPS.get(kind) if isinstance(kind, str) else None
    if group is None:
        raise WireError("bad_field", f"unknown component_type {str(kind)[:40]!r}")
    return group, kind == "mamba"


def _medium(value: Any) -> str:
    upper = check_medium(value)
    return MEDIUMS.get(upper, upper)


# ------------------------------------------------------------------ feeding a source


def take_live(source: EngineSource, frames: list[bytes], now_s: float) -> list[Event]:
    """One SGLang live message into `source`: what EngineSource.take_live does for vLLM.
    Refused output is counted in `source.refused` and changes nothing."""
    return source.take_live(frames, now_s, decode_live)


def take_replay(source: EngineSource, answer: Iterable[list[bytes]], now_s: float) -> list[Event]:
    """SGLang's replay answer to `source.wanted_replay()`, every message up to the end
    marker: the missing batches in order; if the replay no longer holds the first of them,
    the source goes out of sync (no false credit)."""
    return source.take_replay(answer, now_s, decode_replay)


__all__ = [
    "COMPONENT_GROUPS",
    "MEDIUMS",
    "ROOT_PARENT_HASH",
    "decode_live",
    "decode_payload",
    "decode_replay",
    "replay_request",
    "take_live",
    "take_replay",
]
