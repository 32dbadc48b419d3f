"""Loaders for public request traces: Mooncake JSONL and Azure LLM inference CSV.

Mooncake: one JSON object a line with `timestamp` (ms), `input_length`,
`output_length` and `hash_ids` (one id per 512-token block, prefix-chained:
equal ids mean equal prefixes). Each hash id becomes 512 deterministic token
ids (id * 512 + 0..511), so prefix sharing is kept exactly at any
tokens_per_block that divides 512.

Azure: CSV `TIMESTAMP, ContextTokens, GeneratedTokens`; no prefix information,
so every prompt's tokens are its own.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from kvfold.workload.requests import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


def hash_id_tokens(hash_id: int) -> np.ndarray:
    return np.arange(hash_id * 512, hash_id * 512 + 512, dtype=np.int64)


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts_ms, n_in, n_out = rec["timestamp"], rec["input_length"], rec["output_length"]
                ids = rec["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {e}") from None
            blocks = -(-n_in // MOONCAKE_BLOCK_TOKENS)
            if not isinstance(ids, list) or len(ids) != blocks or n_in < 1:
                raise ValueError(
                    f"{path}:{lineno}: input_length {n_in} needs {blocks} hash_ids, got "
                    f"{len(ids) if isinstance(ids, list) else ids!r}"
                )
            prompt = np.concatenate([hash_id_tokens(int(h)) for h in ids])[:n_in]
            out.append(
                TraceRequest(
                    request_id=f"mc-{lineno:06d}",
                    arrival_s=float(ts_ms) / 1000.0,
                    prompt=prompt,
                    max_new_tokens=max(1, int(n_out)),
                    prefix_group=int(ids[0]) if ids else -1,
                )
            )
    return out


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {
            "TIMESTAMP",
            "ContextTokens",
            "GeneratedTokens",
        } <= set(reader.fieldnames):
            raise ValueError(
                f"{path}: expected columns TIMESTAMP, ContextTokens, GeneratedTokens; "
                f"got {reader.fieldnames}"
            )
        for i, row in enumerate(reader):
            if limit is not None and len(out) >= limit:
                break
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}: row {i + 2}: {e}") from None
            t0 = t0 or ts
            base = (i + 1) * 1_000_000_000
            out.append(
                TraceRequest(
                    request_id=f"az-{i:06d}",
                    arrival_s=(ts - t0).total_seconds(),
                    prompt=np.arange(base, base + max(1, n_in), dtype=np.int64),
                    max_new_tokens=max(1, n_out),
                )
            )
    return out


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """By extension: .jsonl is Mooncake, .csv is Azure."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"trace file {str(p)!r} does not exist")
    if p.suffix == ".jsonl":
        return load_mooncake(p, limit)
    if p.suffix == ".csv":
        return load_azure(p, limit)
    raise ValueError(f"trace {str(p)!r}: expected a .jsonl (Mooncake) or .csv (Azure) file")
