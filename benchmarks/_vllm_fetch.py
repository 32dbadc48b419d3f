"""Fetch vLLM 0.33.0's wheel into a cache folder outside the repository and extract the
few source files the benchmark anchor loads (benchmarks/_vllm_anchor.py), once.

``<python> -m pip download vllm==0.33.0 --no-deps`` runs the first time, into
``$KVFOLD_BENCH_CACHE/vllm-0.33.0`` (default ``~/.cache/kvfold/bench/vllm-0.33.0``); the
files are checked against the wheel's RECORD when extracted and on every later use.
``KVFOLD_BENCH_FETCH=0`` forbids the download (a wheel already there is still used).
Anything that stops this raises `AnchorUnavailable`.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
CACHE_ENV = "KVFOLD_BENCH_CACHE"
FETCH_ENV = "KVFOLD_BENCH_FETCH"  # "0": never download
PIP_TIMEOUT_S = 1800

# The wheel files extracted. Loaded as modules: the first four. Parsed only: the rest.
_SOURCES = (
    "vllm/utils/math_utils.py",
    "vllm/utils/hashing.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/utils.py",  # ConstantList only
    "vllm/config/cache.py",  # CacheConfig.prefix_caching_hash_algo default, the algo names
    "vllm/distributed/kv_events.py",  # MEDIUM_GPU
    "vllm/_version.py",
)
_MARKER = ".extracted.json"
_LOCK = threading.Lock()
_LAST_EXTRACT_ERROR = ""


class AnchorUnavailable(RuntimeError):
    """vLLM's block pool could not be fetched or loaded; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------
# Fetching and extracting the wheel
# ---------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where the wheel and its extracted files live (outside the repository)."""
    parent = os.environ.get(CACHE_ENV)
    base = Path(parent).expanduser() if parent else Path.home() / ".cache" / "kvfold" / "bench"
    return base / f"vllm-{VLLM_VERSION}"


def _find_wheel(root: Path) -> Path | None:
    wheels = sorted(root.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def _download_wheel(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=root))
    except OSError as e:
        raise AnchorUnavailable(f"cannot create cache folder {root}: {e}") from e
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"vllm=={VLLM_VERSION}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(tmp),
    ]
    try:
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AnchorUnavailable(f"pip download vllm=={VLLM_VERSION} failed: {e}") from e
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise AnchorUnavailable(
                f"pip download vllm=={VLLM_VERSION} failed (exit {proc.returncode}): {tail}"
            )
        got = _find_wheel(tmp)
        if got is None:
            raise AnchorUnavailable(f"pip download vllm=={VLLM_VERSION} produced no wheel")
        dest = root / got.name
        os.replace(got, dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _extract(wheel: Path, root: Path, src: Path) -> None:
    """Extract `_SOURCES` from the wheel into `src`, checked against the wheel's RECORD."""
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
    try:
        try:
            with zipfile.ZipFile(wheel) as z:
                record_name = f"vllm-{VLLM_VERSION}.dist-info/RECORD"
                record = {
                    row[0]: row[1]
                    for row in csv.reader(io.StringIO(z.read(record_name).decode()))
                    if len(row) >= 2
                }
                digests = {}
                for name in _SOURCES:
                    data = z.read(name)
                    digest = _record_digest(data)
                    if record.get(name) != digest:
                        raise AnchorUnavailable(f"{name} in {wheel.name} does not match RECORD")
                    out = tmp / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data)
                    digests[name] = digest
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            wheel.unlink(missing_ok=True)  # a damaged download: fetch it again next time
            raise AnchorUnavailable(f"cannot read {wheel}: {e}") from e
        (tmp / _MARKER).write_text(json.dumps(digests, indent=1))
        shutil.rmtree(src, ignore_errors=True)
        os.replace(tmp, src)
    except OSError as e:
        # another process may have put its copy in place first: ensure_sources checks,
        # and names this error if the copy there is not whole
        global _LAST_EXTRACT_ERROR
        _LAST_EXTRACT_ERROR = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extracted_ok(src: Path) -> bool:
    """Whether `src` holds exactly `_SOURCES`, byte for byte as extracted from the wheel."""
    try:
        digests = json.loads((src / _MARKER).read_text())
        if sorted(digests) != sorted(_SOURCES):
            return False
        return all(_record_digest((src / n).read_bytes()) == d for n, d in digests.items())
    except (OSError, ValueError):
        return False


def ensure_sources() -> Path:
    """The folder holding vLLM's extracted files, fetching the wheel the first time."""
    root = cache_dir()
    src = root / "src"
    if _extracted_ok(src):
        return src
    wheel = _find_wheel(root)
    if wheel is None:
        if os.environ.get(FETCH_ENV, "1") == "0":
            raise AnchorUnavailable(f"no vLLM wheel in {root}, and {FETCH_ENV}=0 forbids fetching")
        wheel = _download_wheel(root)
    _extract(wheel, root, src)
    if not _extracted_ok(src):
        raise AnchorUnavailable(f"extracting vLLM's files into {src} failed {_LAST_EXTRACT_ERROR}")
    return src
